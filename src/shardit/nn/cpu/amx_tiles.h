#pragma once
// What the AMX kernels (amx_gemm_kernel.cpp, amx_attention_kernel.cpp) share: the tile
// configuration, the pair layout of a tile product's second operand, bf16 <-> fp32 in registers.
// Include only from translation units built with the AMX and AVX-512 -m flags.
#include <immintrin.h>

#include <cstdint>

namespace shardit::nn::cpu::amx {

// Both kernels use the eight tiles one way: tmm0-3 accumulate a 32 x 32 block of fp32 sums (four
// 16 x 16 tiles), tmm4-5 hold 32 rows of the first operand (two 16 x 32 bf16 tiles), tmm6-7 32
// columns of the second (two tiles of 16 k-pairs x 16 columns). 2 x 2 is the largest block that
// eight tiles hold, and each tile load feeds two products.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

/// Every tile 16 rows of 64 bytes; loaded before a kernel's tile loops, released after them.
inline void load_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

/// tmm0-3 = 0: a fresh 32 x 32 block of sums.
inline void zero_sums_2x2() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

/// One step of 32 along the depth: tmm0-3 += a (32 rows x 32 bf16, rows a_stride_bytes apart)
/// times b0 and b1 (pair-layout tiles of 16 columns each, 1 KiB contiguous), each product issued as
/// soon as its two tiles are in.
inline void multiply_accumulate_2x2(const void* a, int64_t a_stride_bytes, const void* b0, const void* b1) {
  _tile_loadd(4, a, a_stride_bytes);
  _tile_loadd(6, b0, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, b1, 64);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(5, static_cast<const char*>(a) + 16 * a_stride_bytes, a_stride_bytes);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

/// The 32 x 32 block of sums in tmm0-3 stored at c (rows `stride` floats apart).
inline void store_sums_2x2(float* c, int64_t stride) {
  const int64_t stride_bytes = stride * int64_t(sizeof(float));
  _tile_stored(0, c, stride_bytes);
  _tile_stored(1, c + 16, stride_bytes);
  _tile_stored(2, c + 16 * stride, stride_bytes);
  _tile_stored(3, c + 16 * stride + 16, stride_bytes);
}

/// The block of sums at c (rows `stride` floats apart) loaded into tmm0-3.
inline void load_sums_2x2(const float* c, int64_t stride) {
  const int64_t stride_bytes = stride * int64_t(sizeof(float));
  _tile_loadd(0, c, stride_bytes);
  _tile_loadd(1, c + 16, stride_bytes);
  _tile_loadd(2, c + 16 * stride, stride_bytes);
  _tile_loadd(3, c + 16 * stride + 16, stride_bytes);
}

/// A 16 x 16 matrix of 32-bit values (rows `stride` apart) transposed into 1 KiB at `dst`.
/// On bf16 pairs it makes the pair layout a tile product reads as its second operand: row r of
/// the tile holds, for each of 16 columns n, the pair src[n][2r], src[n][2r + 1].
inline void transpose_16x16_u32(const uint32_t* src, int64_t stride, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * stride);
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
inline __m512 bf16x16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

/// 16 floats rounded to bf16 (nearest even, as at::linear's outputs) and stored as raw bits.
inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

}  // namespace shardit::nn::cpu::amx
