#pragma once
// The BLAS library's kernel set ("core") against the CPU: OpenBLAS picks its kernels from the CPU
// it recognises when it loads, and Debian 12's OpenBLAS names some current CPUs after older ones
// (AMD Zen 4 "Haswell", some Xeons "Prescott"), running narrower vectors than the CPU has. auto's
// GEMM choice (gemm.h) reads the core, and every shardit program starts by moving OpenBLAS onto the
// right core (run_on_cpu_blas_kernels), so that all of them, and the ranks they start, compute
// with the same kernels.
#include <string>

namespace shardit::nn::cpu {

/// The name of the kernel set the BLAS library chose for this CPU ("Prescott", "SkylakeX", ...)
/// where it says (OpenBLAS's openblas_get_corename), "" otherwise. OPENBLAS_CORETYPE overrides
/// OpenBLAS's choice at process start.
std::string blas_core_name();

/// The vector set the BLAS library's kernels use, from its core name: 3 AVX-512 (SkylakeX,
/// Cooperlake, SapphireRapids), 2 AVX2 (Haswell, Zen, Excavator), 1 older (Prescott, Nehalem,
/// Sandybridge, ...), 0 unknown (no OpenBLAS, or a name not in the table).
int blas_vector_level(const std::string& core_name);

/// The same scale for the level the kernels may use (dispatch.h's cpu_isa()): 3 AVX-512, 2 AVX2
/// with FMA, 1 older.
int cpu_vector_level();

/// The OpenBLAS core whose kernels use the CPU's vector set ("SkylakeX" for AVX-512, "Haswell"
/// for AVX2 with FMA) when the core OpenBLAS chose at start-up is a narrower one, "" when its
/// choice is right, unknown, or not OpenBLAS's. From cpuid and the core name only: the same on
/// every run.
std::string better_blas_core();

/// Program start-up: when better_blas_core() names a core and neither OPENBLAS_CORETYPE nor
/// SHARDIT_KEEP_BLAS_CORE is set, sets OPENBLAS_CORETYPE to it and executes the program again
/// (OpenBLAS reads it only when it loads, before main). The ranks a program launches inherit it.
/// Returns (doing nothing) where it does not apply or the exec fails. Call first thing in main.
void run_on_cpu_blas_kernels(char** argv);

}  // namespace shardit::nn::cpu
