#pragma once
// What the AMX kernels (amx_gemm_kernel.cpp, amx_attention_kernel.cpp) share: the tile
// configuration and the 2 x 2 steps of tile products (the pair layout: bf16_pairs.h).
// Include only from translation units built with the AMX and AVX-512 -m flags.
#include <immintrin.h>

#include <cstdint>

#include "shardit/nn/cpu/bf16_pairs.h"

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
static inline void load_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

/// tmm0-3 = 0: a fresh 32 x 32 block of sums.
static inline void zero_sums_2x2() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

/// One step of 32 along the depth: tmm0-3 += a (32 rows x 32 bf16, rows a_stride_bytes apart)
/// times b0 and b1 (pair-layout tiles of 16 columns each, 1 KiB contiguous), each product issued as
/// soon as its two tiles are in.
static inline void multiply_accumulate_2x2(const void* a, int64_t a_stride_bytes, const void* b0, const void* b1) {
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
static inline void store_sums_2x2(float* c, int64_t stride) {
  const int64_t stride_bytes = stride * int64_t(sizeof(float));
  _tile_stored(0, c, stride_bytes);
  _tile_stored(1, c + 16, stride_bytes);
  _tile_stored(2, c + 16 * stride, stride_bytes);
  _tile_stored(3, c + 16 * stride + 16, stride_bytes);
}

/// The block of sums at c (rows `stride` floats apart) loaded into tmm0-3.
static inline void load_sums_2x2(const float* c, int64_t stride) {
  const int64_t stride_bytes = stride * int64_t(sizeof(float));
  _tile_loadd(0, c, stride_bytes);
  _tile_loadd(1, c + 16, stride_bytes);
  _tile_loadd(2, c + 16 * stride, stride_bytes);
  _tile_loadd(3, c + 16 * stride + 16, stride_bytes);
}

}  // namespace shardit::nn::cpu::amx
