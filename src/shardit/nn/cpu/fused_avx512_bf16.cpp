// fused_kernels.h built for AVX-512 with AVX512-BF16, which converts floats to bf16 in one
// instruction (the other builds take eight): compiled with its -m flags and chosen only on a CPU
// that has it. Left empty where the compiler or Sleef's header (which at::vec's AVX headers
// include) is missing: SHARDIT_FUSED_KERNELS_OFF.
#include "shardit/nn/cpu/fused_table.h"

#ifndef SHARDIT_FUSED_KERNELS_OFF
// Its own namespace name (at::vec's too), so that its inline functions are not the avx512 build's.
#define CPU_CAPABILITY AVX512_BF16
#define CPU_CAPABILITY_AVX512
#define SHARDIT_NATIVE_BF16
#define SHARDIT_CAPABILITY_NAME "avx512_bf16"
#include "shardit/nn/cpu/fused_kernels.h"

namespace shardit::nn::cpu {
FusedKernelTable fused_kernels_avx512_bf16() { return make_table(); }
}  // namespace shardit::nn::cpu
#else
namespace shardit::nn::cpu {
FusedKernelTable fused_kernels_avx512_bf16() { return {}; }
}  // namespace shardit::nn::cpu
#endif
