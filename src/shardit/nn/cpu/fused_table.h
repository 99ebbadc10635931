#pragma once
// The function table that each instruction-set build of fused_kernels.h fills (see there).
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace shardit::nn::cpu {

struct FusedKernelTable {
  const char* name = "none";
  void (*gelu_tanh_bf16)(c10::BFloat16* x, int64_t n) = nullptr;
  void (*rms_norm_row_bf16)(const c10::BFloat16* x, c10::BFloat16* out, const c10::BFloat16* weight, int64_t n,
                            float eps) = nullptr;
  void (*rms_norm_row_bf16_f32w)(const c10::BFloat16* x, c10::BFloat16* out, const float* weight, int64_t n,
                                 float eps) = nullptr;
  void (*layer_norm_modulate_row_bf16)(const c10::BFloat16* x, c10::BFloat16* out, const c10::BFloat16* scale1,
                                       const c10::BFloat16* shift, int64_t n, float eps) = nullptr;
  void (*rope_interleaved_row_f32)(const float* x, float* out, const float* cos, const float* sin,
                                   int64_t n) = nullptr;
  void (*rope_interleaved_row_bf16)(const c10::BFloat16* x, c10::BFloat16* out, const float* cos, const float* sin,
                                    int64_t n) = nullptr;
  void (*softmax_row_f32)(const float* scores, const bool* mask, int64_t n, float scale, bool normalize, float* probs,
                          float* row_max, float* row_sum, float* scratch) = nullptr;
  void (*softmax_row_bf16)(const c10::BFloat16* scores, const bool* mask, int64_t n, float scale, bool normalize,
                           c10::BFloat16* probs, float* row_max, float* row_sum, float* scratch) = nullptr;
};

/// The tables of this build: AVX-512 (with and without AVX512-BF16) and AVX2 ones exist only where
/// the compiler and Sleef (the vector math library LibTorch uses) allowed them; the default one
/// always exists.
FusedKernelTable fused_kernels_avx512_bf16();
FusedKernelTable fused_kernels_avx512();
FusedKernelTable fused_kernels_avx2();
FusedKernelTable fused_kernels_default();

}  // namespace shardit::nn::cpu
