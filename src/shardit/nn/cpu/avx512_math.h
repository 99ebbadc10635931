#pragma once
// AVX-512 math shared by the fused kernels' AVX-512 builds (fused_kernels.h) and the AMX
// attention (amx_attention_kernel.cpp). Include only from translation units built with AVX-512F;
// the functions are static, so each translation unit keeps its own copy under its own flags.
#include <immintrin.h>

namespace shardit::nn::cpu::avx512 {

/// 2^t for the attention weights, where t <= 0 (a scaled score minus the row's maximum, in
/// log2 units): t = n + f with n an integer and |f| <= 1/2, 2^f from a degree-6 polynomial fitted
/// to it (relative error 2e-9, under the float's own rounding), scaled by 2^n. Below 2^-126 (the
/// smallest normal float; t = -inf included) it returns 0: a subnormal weight would only slow the
/// product with the values. NaN stays NaN. For t > 0 the result is not meaningful.
static inline __m512 exp2_nonpositive(__m512 t) {
  // q(f) = (2^f - 1) / f, highest power first; 2^f = 1 + f q(f) is exactly 1 at f = 0.
  constexpr float kQ[6] = {1.5353361959569156e-4f, 1.3398875016719103e-3f, 9.61843691766262e-3f,
                           5.5503323674201965e-2f, 2.4022647738456726e-1f, 6.931471824645996e-1f};
  // max(-127, t) returns its second operand for a NaN t: NaN goes through.
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-127.0f), t);
  const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(clamped, n);
  __m512 q = _mm512_set1_ps(kQ[0]);
  for (int i = 1; i < 6; ++i) q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(kQ[i]));
  const __m512 p = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
  // Kept: t >= -126, or NaN (unordered).
  const __mmask16 kept = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(kept, p, n);
}

}  // namespace shardit::nn::cpu::avx512
