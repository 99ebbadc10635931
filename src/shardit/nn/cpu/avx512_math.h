#pragma once
// AVX-512 math shared by the fused kernels' AVX-512 builds (fused_kernels.h) and the AMX kernels
// (the attention's softmax, the Linear's GELU epilogue). Include only from translation units built with AVX-512F;
// the functions are static, so each translation unit keeps its own copy under its own flags.
#include <immintrin.h>

#include "shardit/nn/cpu/exp2_polynomials.h"

namespace shardit::nn::cpu::avx512 {

/// 2^t for the attention weights, where t <= 0 (a scaled score minus the row's maximum, in
/// log2 units): t = n + f with n an integer and |f| <= 1/2, 2^f from a degree-6 polynomial fitted
/// to it (relative error 2e-9, under the float's own rounding), scaled by 2^n. Below 2^-126 (the
/// smallest normal float; t = -inf included) it returns 0: a subnormal weight would only slow the
/// product with the values. NaN stays NaN. For t > 0 the result is not meaningful.
static inline __m512 exp2_nonpositive(__m512 t) {
  // max(-127, t) returns its second operand for a NaN t: NaN goes through.
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-127.0f), t);
  const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(clamped, n);
  __m512 q = _mm512_set1_ps(kExp2Degree6[0]);
  for (int i = 1; i < 6; ++i) q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(kExp2Degree6[i]));
  const __m512 p = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
  // Kept: t >= -126, or NaN (unordered).
  const __mmask16 kept = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(kept, p, n);
}

/// 1 / (1 + 2^t): 2^t as in exp2_nonpositive but with a degree-4 polynomial (relative error
/// 3e-6, far under a bf16 result's rounding, 4e-3) and t clamped to [-126, 126] (1 / (1 + 2^126)
/// is a normal float, so no case needs a mask); the reciprocal of d = 1 + 2^t >= 1 from the
/// hardware's estimate and one Newton step (relative error ~1e-7) instead of a division. NaN stays
/// NaN.
static inline __m512 reciprocal_one_plus_exp2(__m512 t) {
  // min(126, max(-126, t)): each returns its second operand for a NaN, so NaN goes through.
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(126.0f), _mm512_max_ps(_mm512_set1_ps(-126.0f), t));
  const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(clamped, n);
  __m512 q = _mm512_set1_ps(kExp2Degree4[0]);
  for (int i = 1; i < 4; ++i) q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(kExp2Degree4[i]));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_scalef_ps(_mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f)), n));
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

/// gelu(x, approximate="tanh") = x * 0.5 * (1 + tanh(y)) = x / (1 + e^(-2y)), with
/// y = sqrt(2/pi) * (x + 0.044715 x^3): e^(-2y) as 2^(-2 y log2(e)).
static inline __m512 gelu_tanh(__m512 x) {
  // -2 sqrt(2/pi) log2(e)
  const __m512 minus_two_beta_log2e = _mm512_set1_ps(-2.0f * 0.7978845608028654f * 1.4426950408889634f);
  // y / sqrt(2/pi) = x (1 + kappa x^2)
  const __m512 inner = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), x,
                                                        _mm512_set1_ps(1.0f)));
  return _mm512_mul_ps(x, reciprocal_one_plus_exp2(_mm512_mul_ps(minus_two_beta_log2e, inner)));
}

}  // namespace shardit::nn::cpu::avx512
