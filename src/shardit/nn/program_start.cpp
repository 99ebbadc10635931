#include "shardit/nn/program_start.h"

#include "shardit/core/heap.h"
#include "shardit/nn/cpu/blas_core.h"
#include "shardit/nn/cpu/dispatch.h"

namespace shardit::nn {

void start_program(char** argv) {
  keep_freed_memory_for_reuse();
  cpu::cpu_isa();
  cpu::run_on_cpu_blas_kernels(argv);
}

}  // namespace shardit::nn
