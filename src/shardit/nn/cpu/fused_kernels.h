#pragma once
// The row kernels behind nn/cpu/fused.h: element-wise work that LibTorch 1.13 runs as several
// passes (and, in bf16, through scalar loops), done in one pass per row with fp32 arithmetic and
// one rounding to the output's dtype.
//
// This header is compiled once per instruction set, by fused_avx512_bf16.cpp, fused_avx512.cpp,
// fused_avx2.cpp and fused_default.cpp, each of which defines CPU_CAPABILITY (ATen's convention:
// at::vec's Vectorized<float> is 16, 8 or a scalar-loop "vector" wide, in a namespace of that
// name) and then includes this file; the first also defines SHARDIT_NATIVE_BF16 (bf16 stores
// through AVX512-BF16's conversion). fused.cpp picks the table for the CPU it runs on
// (core/cpu_features), so the kernel, and the bits, depend on the machine, never on its load.
// Each row is computed by one thread in a fixed order, so the result does not depend on the
// thread count either.
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <utility>
#include <cmath>
#include <cstdint>
#include <limits>

#include "shardit/nn/cpu/exp2_polynomials.h"
#include "shardit/nn/cpu/fused_table.h"
#if defined(CPU_CAPABILITY_AVX512)
#include "shardit/nn/cpu/avx512_math.h"
#endif

namespace shardit::nn::cpu {
inline namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

/// The first `count` floats of p, the other lanes 0.
inline Vec load_partial(const float* p, int64_t count) {
  float buffer[kLanes] = {};
  for (int64_t i = 0; i < count; ++i) buffer[i] = p[i];
  return Vec::loadu(buffer);
}

/// fp32 vectors from and to float or bf16 memory; `count` < kLanes for a row's tail.
template <class T>
struct Lanes;

template <>
struct Lanes<float> {
  static Vec load(const float* p) { return Vec::loadu(p); }
  static Vec load(const float* p, int64_t count) { return load_partial(p, count); }
  static void store(float* p, const Vec& v) { v.store(p); }
  static void store(float* p, const Vec& v, int64_t count) { v.store(p, count); }
};

template <>
struct Lanes<c10::BFloat16> {
  static Vec load(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
    // bf16 is the high half of a float: widen to 32 bits, shift left by 16.
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
#else
    return load(p, kLanes);
#endif
  }
  static Vec load(const c10::BFloat16* p, int64_t count) {
    float buffer[kLanes] = {};
    for (int64_t i = 0; i < count; ++i) buffer[i] = static_cast<float>(p[i]);
    return Vec::loadu(buffer);
  }
  static void store(c10::BFloat16* p, const Vec& v) {
#if defined(SHARDIT_NATIVE_BF16)
    // AVX512-BF16's conversion: nearest even, as below, in one instruction; unlike c10 it flushes
    // subnormal floats (below 1.2e-38) to zero and keeps a NaN's sign and payload.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#elif defined(CPU_CAPABILITY_AVX512)
    // Rounds to nearest even, NaN to the quiet NaN 0x7fc0: what c10::BFloat16(float) does.
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan);
    const __m256i high = _mm256_srli_epi32(rounded, 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
#else
    float buffer[kLanes];
    v.store(buffer);
    for (int64_t i = 0; i < kLanes; ++i) p[i] = c10::BFloat16(buffer[i]);
#endif
  }
  static void store(c10::BFloat16* p, const Vec& v, int64_t count) {
    // Through the whole-vector store, so a row's tail rounds as the rest of it does.
    c10::BFloat16 buffer[kLanes];
    store(buffer, v);
    for (int64_t i = 0; i < count; ++i) p[i] = buffer[i];
  }
};

/// x rounded to bf16 and back (what storing a bf16 intermediate does), in registers.
inline Vec round_to_bf16(const Vec& x) {
  c10::BFloat16 rounded[kLanes];
  Lanes<c10::BFloat16>::store(rounded, x);
  return Lanes<c10::BFloat16>::load(rounded);
}

/// Applies `f` (Vec -> Vec) to x[0, n) in place.
template <class T, class F>
void map_in_place(T* x, int64_t n, F f) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Lanes<T>::store(x + i, f(Lanes<T>::load(x + i)));
  if (i < n) Lanes<T>::store(x + i, f(Lanes<T>::load(x + i, n - i)), n - i);
}

/// exp(x) to about 1 ulp, several times cheaper than at::vec's exp (Sleef's, to 1 ulp with
/// special cases): Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, Cephes' degree-6 expf
/// polynomial for e^r (in FMAs), then the exponent scaled by n. Below -87.3 (and at -inf) it
/// returns 0: e^x is then under the smallest normal float, and softmax weights and sigmoids lose
/// nothing. Above 88 it saturates at e^88; NaN stays NaN. The portable build calls std::exp.
inline Vec fast_exp(const Vec& x) {
  // Written in each instruction set's intrinsics: the same steps through at::vec (its NaN-aware
  // maximum and minimum, its round) measured 2.3x slower.
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 lowest = _mm512_set1_ps(-87.33654f);
  // max(lowest, x) and min(88, .) return their second operand for a NaN x: NaN goes through.
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(lowest, x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 scaled = _mm512_scalef_ps(p, n);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  return Vec(_mm512_mask_mov_ps(scaled, underflow, _mm512_setzero_ps()));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 lowest = _mm256_set1_ps(-87.33654f);
  const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lowest, x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n from the exponent bits (n in [-126, 127] after the clamps; NaN gives NaN through p).
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 scaled = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  return Vec(_mm256_andnot_ps(_mm256_cmp_ps(x, lowest, _CMP_LT_OQ), scaled));
#else
  return x.exp();
#endif
}

/// 2^t for the attention weights, where t <= 0 (a scaled score minus the row's maximum, in
/// log2 units); cheaper than fast_exp(t ln2) because the softmax folds log2(e) into its scale.
/// The AVX-512 builds share avx512::exp2_nonpositive (avx512_math.h) with the AMX attention; the
/// AVX2 one is the same steps in 8 lanes: degree-6 polynomial for 2^f, |f| <= 1/2, scaled by 2^n;
/// 0 below 2^-126 (t = -inf included), NaN stays NaN, t > 0 not meaningful.
inline Vec exp2_nonpositive(const Vec& t) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(avx512::exp2_nonpositive(t));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 clamped = _mm256_max_ps(_mm256_set1_ps(-127.0f), t);
  const __m256 n = _mm256_round_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(clamped, n);
  __m256 q = _mm256_set1_ps(kExp2Degree6[0]);
  for (int i = 1; i < 6; ++i) q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(kExp2Degree6[i]));
  const __m256 p = _mm256_fmadd_ps(q, f, _mm256_set1_ps(1.0f));
  // 2^n from the exponent bits (n in [-127, 0] for the t that matter; NaN gives NaN through p).
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 scaled = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  return Vec(_mm256_andnot_ps(_mm256_cmp_ps(t, _mm256_set1_ps(-126.0f), _CMP_LT_OQ), scaled));
#else
  return fast_exp(t * Vec(static_cast<float>(M_LN2)));
#endif
}

/// 1 / (1 + 2^t), for the GELU below: a degree-4 polynomial for 2^f and the reciprocal from the
/// hardware's estimate and one Newton step instead of a division, the slowest instruction of the
/// old kernel; together 1.5x faster on FLUX.1's `[1536, 12288]`. The AVX-512 builds share
/// avx512::reciprocal_one_plus_exp2 (avx512_math.h, where its error bounds are) with the AMX
/// Linear's GELU epilogue; the AVX2 one is the same steps in 8 lanes. NaN stays NaN.
inline Vec reciprocal_one_plus_exp2(const Vec& t) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(avx512::reciprocal_one_plus_exp2(t));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(126.0f), _mm256_max_ps(_mm256_set1_ps(-126.0f), t));
  const __m256 n = _mm256_round_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(clamped, n);
  __m256 q = _mm256_set1_ps(kExp2Degree4[0]);
  for (int i = 1; i < 4; ++i) q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(kExp2Degree4[i]));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f),
                                 _mm256_mul_ps(_mm256_fmadd_ps(q, f, _mm256_set1_ps(1.0f)), _mm256_castsi256_ps(exponent)));
  // rcp_ps: 12 bits; one Newton step squares its error.
  const __m256 r = _mm256_rcp_ps(d);
  return Vec(_mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.0f))));
#else
  return Vec(1.0f) / (Vec(1.0f) + fast_exp(t * Vec(static_cast<float>(M_LN2))));
#endif
}

/// gelu(x, approximate="tanh") = x * 0.5 * (1 + tanh(y)), y = sqrt(2/pi) * (x + 0.044715 x^3),
/// computed as x / (1 + e^(-2y)) (the same function: 0.5 (1 + tanh y) is the logistic of 2y),
/// which needs one exponential and no tanh; e^(-2y) = 2^(-2y log2 e).
template <class T>
void gelu_tanh(T* x, int64_t n) {
  const Vec minus_two_beta_log2e(static_cast<float>(-2.0 * M_SQRT2 * M_2_SQRTPI * 0.5 * M_LOG2E));
  const Vec kappa(0.044715f);
  const Vec one(1.0f);
  map_in_place(x, n, [&](const Vec& v) {
    // y / sqrt(2/pi) = x (1 + kappa x^2)
    const Vec inner = v * at::vec::fmadd(kappa * v, v, one);
    return v * reciprocal_one_plus_exp2(minus_two_beta_log2e * inner);
  });
}

/// One row of RMSNorm: out = x / sqrt(mean(x^2) + eps), times the weight when given. With a bf16
/// weight the normalised row is rounded to bf16 before the product (diffusers' RMSNorm casts to
/// the weight's dtype first); with an fp32 weight the product is in fp32.
template <class T, class W>
void rms_norm_row(const T* x, T* out, const W* weight, int64_t n, float eps) {
  Vec squares(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = Lanes<T>::load(x + i);
    squares = squares + v * v;
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  float lanes[kLanes];
  squares.store(lanes);
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  sum += tail;
  const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const Vec inv(inv_rms);
  const auto normalise = [&](const Vec& v, const W* w, int64_t count) {
    Vec y = v * inv;
    if (w == nullptr) return y;
    if constexpr (std::is_same_v<W, c10::BFloat16>) {
      // Round to bf16 first, as diffusers' y.to(weight.dtype) * weight does.
      y = round_to_bf16(y);
    }
    return y * (count == kLanes ? Lanes<W>::load(w) : Lanes<W>::load(w, count));
  };
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    Lanes<T>::store(out + j, normalise(Lanes<T>::load(x + j), weight == nullptr ? nullptr : weight + j, kLanes));
  }
  if (j < n) {
    Lanes<T>::store(out + j, normalise(Lanes<T>::load(x + j, n - j), weight == nullptr ? nullptr : weight + j, n - j),
                    n - j);
  }
}

/// One row of bf16 LayerNorm (no affine) followed by the adaLN modulation:
///   out = bf16(bf16(bf16(layer_norm(x)) * scale1) + shift),  scale1 = 1 + scale (bf16),
/// the roundings diffusers' bf16 `norm(x) * (1 + scale) + shift` makes, with the statistics in
/// fp32 (mean, then the mean squared deviation) as LibTorch's bf16 LayerNorm keeps them.
inline void layer_norm_modulate_row_bf16(const c10::BFloat16* x, c10::BFloat16* out, const c10::BFloat16* scale1,
                                         const c10::BFloat16* shift, int64_t n, float eps) {
  using L = Lanes<c10::BFloat16>;
  const auto load = [](const c10::BFloat16* p, int64_t count) { return count == kLanes ? L::load(p) : L::load(p, count); };
  Vec sums(0.0f);
  for (int64_t j = 0; j < n; j += kLanes) sums = sums + load(x + j, std::min(kLanes, n - j));
  float lanes[kLanes];
  sums.store(lanes);
  float total = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  const float mean = total / static_cast<float>(n);
  const Vec mean_v(mean);
  Vec squares(0.0f);
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min(kLanes, n - j);
    // Padding lanes load 0: mask their deviation out.
    Vec d = load(x + j, count) - mean_v;
    if (count < kLanes) {
      float dev[kLanes];
      d.store(dev);
      for (int64_t l = count; l < kLanes; ++l) dev[l] = 0.0f;
      d = Vec::loadu(dev);
    }
    squares = squares + d * d;
  }
  squares.store(lanes);
  float deviation = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) deviation += lanes[l];
  const Vec rstd(1.0f / std::sqrt(deviation / static_cast<float>(n) + eps));
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min(kLanes, n - j);
    const Vec normed = round_to_bf16((load(x + j, count) - mean_v) * rstd);
    const Vec scaled = round_to_bf16(normed * load(scale1 + j, count));
    const Vec y = scaled + load(shift + j, count);
    if (count == kLanes) {
      L::store(out + j, y);
    } else {
      L::store(out + j, y, count);
    }
  }
}

/// (v1, v0, v3, v2, ...): each pair of lanes swapped.
inline Vec swap_pairs(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_permute_ps(v, 0xB1));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_permute_ps(v, 0xB1));
#else
  float lanes[kLanes];
  v.store(lanes);
  for (int64_t l = 0; l + 1 < kLanes; l += 2) std::swap(lanes[l], lanes[l + 1]);
  return Vec::loadu(lanes);
#endif
}

/// One row of interleaved rotary embedding (diffusers' apply_rotary_emb with
/// use_real_unbind_dim=-1): channel pairs (2i, 2i+1) rotate by the angle of pair i, in fp32:
///   out[2i]   = x[2i] cos[2i]     - x[2i+1] sin[2i]
///   out[2i+1] = x[2i+1] cos[2i+1] + x[2i]   sin[2i+1]
/// as x * cos + swap_pairs(x) * (-sin, +sin, ...), each product rounded before the sum as
/// diffusers' separate operations round it (no FMA: this file is compiled with
/// -ffp-contract=off, and written with explicit vector operations because GCC's vectoriser
/// turns the scalar form into fused multiply-add/subtract regardless).
template <class T>
void rope_interleaved_row(const T* x, T* out, const float* cos, const float* sin, int64_t n) {
  float signs[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) signs[l] = l % 2 == 0 ? -1.0f : 1.0f;
  const Vec sign = Vec::loadu(signs);
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min(kLanes, n - j);
    const bool whole = count == kLanes;
    const Vec v = whole ? Lanes<T>::load(x + j) : Lanes<T>::load(x + j, count);
    const Vec c = whole ? Lanes<float>::load(cos + j) : Lanes<float>::load(cos + j, count);
    const Vec s = whole ? Lanes<float>::load(sin + j) : Lanes<float>::load(sin + j, count);
    const Vec y = v * c + swap_pairs(v) * (s * sign);
    if (whole) {
      Lanes<T>::store(out + j, y);
    } else {
      Lanes<T>::store(out + j, y, count);
    }
  }
}

/// One row of attention weights: e_j = exp(scale * (s_j - max)) over the keys that `mask` allows
/// (all when null; 0 for the others), computed as 2^((s_j - max) * scale * log2(e)) (scale > 0),
/// written to `probs` (which may be `scores` itself), divided by their sum when `normalize`.
/// Returns the scaled maximum (-inf when every key is masked) and the sum through `row_max` and
/// `row_sum`. `scratch` holds kLanes floats.
template <class S, class P>
void softmax_row(const S* scores, const bool* mask, int64_t n, float scale, bool normalize, P* probs,
                 float* row_max, float* row_sum, float* scratch) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const auto load = [](const S* p, int64_t count) { return count == kLanes ? Lanes<S>::load(p) : Lanes<S>::load(p, count); };
  const auto store = [](P* p, const Vec& v, int64_t count) {
    if (count == kLanes) {
      Lanes<P>::store(p, v);
    } else {
      Lanes<P>::store(p, v, count);
    }
  };
  // Pass 1: the maximum over the allowed keys (NaN wins, so a NaN score gives NaN weights).
  float max_value = kNegInf;
  bool nan = false;
  if (mask == nullptr) {
    Vec maxima(kNegInf);
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) maxima = at::vec::maximum(maxima, Lanes<S>::load(scores + j));
    maxima.store(scratch);
    for (int64_t l = 0; l < kLanes; ++l) {
      nan = nan || std::isnan(scratch[l]);
      max_value = std::max(max_value, scratch[l]);
    }
    for (; j < n; ++j) {
      const float v = static_cast<float>(scores[j]);
      nan = nan || std::isnan(v);
      max_value = std::max(max_value, v);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      if (!mask[j]) continue;
      const float v = static_cast<float>(scores[j]);
      nan = nan || std::isnan(v);
      max_value = std::max(max_value, v);
    }
  }
  if (nan) max_value = std::numeric_limits<float>::quiet_NaN();
  // A row whose keys are all masked: every weight 0 (exp(-inf)), shift by 0 rather than -inf.
  const float shift = max_value == kNegInf ? 0.0f : max_value;
  const Vec scale_log2e(scale * static_cast<float>(M_LOG2E)), shift_v(shift);
  // Pass 2: the weights, unnormalised, and their sum (lanes past n and masked keys add 0).
  Vec sums(0.0f);
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min(kLanes, n - j);
    Vec e = exp2_nonpositive(scale_log2e * (load(scores + j, count) - shift_v));
    if (mask != nullptr || count < kLanes) {
      e.store(scratch);
      for (int64_t l = 0; l < kLanes; ++l) {
        if (l >= count || (mask != nullptr && !mask[j + l])) scratch[l] = 0.0f;
      }
      e = Vec::loadu(scratch);
    }
    store(probs + j, e, count);
    sums = sums + e;
  }
  sums.store(scratch);
  float total = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) total += scratch[l];
  *row_sum = total;
  *row_max = max_value == kNegInf ? kNegInf : scale * max_value;
  if (!normalize || !(total > 0.0f)) return;
  // Pass 3: divide by the sum (probs are re-read in their own dtype: the weights are rounded
  // to it before the division, as a bf16 softmax of bf16 scores rounds them).
  const Vec inverse(1.0f / total);
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min(kLanes, n - j);
    const Vec e = count == kLanes ? Lanes<P>::load(probs + j) : Lanes<P>::load(probs + j, count);
    store(probs + j, e * inverse, count);
  }
}

inline FusedKernelTable make_table() {
  FusedKernelTable table;
  table.name = SHARDIT_CAPABILITY_NAME;
  table.gelu_tanh_bf16 = &gelu_tanh<c10::BFloat16>;
  table.rms_norm_row_bf16 = &rms_norm_row<c10::BFloat16, c10::BFloat16>;
  table.rms_norm_row_bf16_f32w = &rms_norm_row<c10::BFloat16, float>;
  table.layer_norm_modulate_row_bf16 = &layer_norm_modulate_row_bf16;
  table.rope_interleaved_row_f32 = &rope_interleaved_row<float>;
  table.rope_interleaved_row_bf16 = &rope_interleaved_row<c10::BFloat16>;
  table.softmax_row_f32 = &softmax_row<float, float>;
  table.softmax_row_bf16 = &softmax_row<c10::BFloat16, c10::BFloat16>;
  return table;
}

}  // namespace CPU_CAPABILITY
}  // namespace shardit::nn::cpu
