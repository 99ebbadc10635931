// fused_kernels.h built for AVX2, compiled with its -m flags and chosen only on a CPU that has it. Left empty where the
// compiler or Sleef's header (which at::vec's AVX headers include) is missing:
// SHARDIT_FUSED_KERNELS_OFF.
#include "shardit/nn/cpu/fused_table.h"

#ifndef SHARDIT_FUSED_KERNELS_OFF
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define SHARDIT_CAPABILITY_NAME "avx2"
#include "shardit/nn/cpu/fused_kernels.h"

namespace shardit::nn::cpu {
FusedKernelTable fused_kernels_avx2() { return make_table(); }
}  // namespace shardit::nn::cpu
#else
namespace shardit::nn::cpu {
FusedKernelTable fused_kernels_avx2() { return {}; }
}  // namespace shardit::nn::cpu
#endif
