#pragma once
// What every shardit program does first thing in main (the CLI, the bench, the test executables,
// the examples), so that all of them, and the ranks they start, compute with the same kernels.

namespace shardit::nn {

/// Keeps freed large blocks for reuse (core/heap.h); moves OpenBLAS onto the kernels of this CPU
/// (cpu/blas_core.h: this may execute the program again, with the same `argv`); reads the
/// instruction-set cap SHARDIT_CPU_ISA (cpu/dispatch.h), so that a bad value fails here, naming the
/// variable, rather than at the first kernel call.
void start_program(char** argv);

}  // namespace shardit::nn
