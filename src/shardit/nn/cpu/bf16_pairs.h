#pragma once
// The pair layout of bf16 products and bf16 <-> fp32 in registers, shared by the kernels that
// multiply bf16 in pairs: AMX tiles (amx_tiles.h) and AVX512-BF16's vdpbf16ps. Both read their
// second operand as rows of 16 columns, each column a pair of consecutive depth values in one
// 32-bit word. Include only from translation units built with AVX-512F and AVX512-BF16; the
// functions are static, so each translation unit keeps its own copy under its own flags.
#include <immintrin.h>

#include <cstdint>

namespace shardit::nn::cpu::pairs {

/// 16 rows of 32 bf16 values (rows `stride` values apart, any 2-byte alignment), as 16 x 16 pairs,
/// transposed into 1 KiB at `dst`: the pair layout of a product's second operand. Row r of the
/// result holds, for each of the 16 source rows n, the pair src[n][2r], src[n][2r + 1]. The rows
/// are read through unaligned vector loads of raw bytes, never as 32-bit values.
static inline void transpose_16x16_pairs(const uint16_t* src, int64_t stride, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(static_cast<const void*>(src + i * stride));
  // Within each 128-bit lane: pairs of rows interleaved, then quadruples.
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4i + c], lane j now holds rows 4i..4i+3 of column 4j + c: gather the lanes per column.
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88),
                  f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_storeu_si512(dst + 16 * c, _mm512_shuffle_i32x4(a, e, 0x88));
    _mm512_storeu_si512(dst + 16 * (8 + c), _mm512_shuffle_i32x4(a, e, 0xDD));
    _mm512_storeu_si512(dst + 16 * (4 + c), _mm512_shuffle_i32x4(b, f, 0x88));
    _mm512_storeu_si512(dst + 16 * (12 + c), _mm512_shuffle_i32x4(b, f, 0xDD));
  }
}

/// 16 bf16 values (raw bits) as floats: bf16 is the high half of a float.
static inline __m512 bf16x16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

/// 16 floats rounded to bf16 (nearest even, as at::linear's outputs) and stored as raw bits.
static inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

}  // namespace shardit::nn::cpu::pairs
