// The AMX tile loops of nn/cpu/amx_gemm.h, compiled with the AMX and AVX-512 -m flags and called
// only on a CPU that has them. Raw pointers and no library templates here: an inline function
// instantiated in a translation unit with these flags could be the copy the linker keeps for the
// whole program, and would then fault on CPUs without them.
#include "shardit/nn/cpu/amx_gemm_kernel.h"

#ifndef SHARDIT_AMX_GEMM_OFF
#include <immintrin.h>

#include <cstring>

namespace shardit::nn::cpu {

namespace {

// Tile registers: tmm0-3 accumulate a 32 x 32 block of y (four 16 x 16 fp32 tiles), tmm4-5 hold
// 32 rows of x (two 16 x 32 bf16 tiles), tmm6-7 32 columns of w (two tiles of 16 k-pairs x 16
// columns). 2 x 2 is the largest block that eight tiles hold, and each tile load feeds two products.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

/// A 16 x 16 matrix of 32-bit values (rows `stride` apart) transposed into 1 KiB at `dst`.
/// On bf16 pairs it makes the VNNI layout a tile product reads: row r of a w tile holds, for each
/// of 16 columns n, the pair w[n][2r], w[n][2r + 1].
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

inline __m512 bf16x16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

}  // namespace

bool amx_gemm_kernel_built() { return true; }

void amx_bf16_linear_columns(const AmxLinearArgs& args, int64_t n_begin, int64_t n_end, const AmxScratch& scratch) {
  const int64_t K = args.in, M = args.rows;
  const int64_t k_steps = K / 32;
  // Column blocks of 16 of w[n_begin, n_end) packed once for every row block: tile (b, s) at
  // packed + (b * k_steps + s) * 256.
  for (int64_t block = 0; block < (n_end - n_begin) / 16; ++block) {
    const uint16_t* rows = args.w + (n_begin + 16 * block) * args.w_stride;
    for (int64_t s = 0; s < k_steps; ++s) {
      transpose_16x16_u32(reinterpret_cast<const uint32_t*>(rows + 32 * s), args.w_stride / 2,
                          scratch.packed_w + (block * k_steps + s) * 256);
    }
  }
  // The last rows when M is not a multiple of 32, zero-padded to 32 (a tile load reads 16 rows),
  // the parts side by side.
  const int64_t full_rows = M / 32 * 32;
  if (full_rows < M) {
    std::memset(scratch.tail_rows, 0, sizeof(uint16_t) * 32 * K);
    int64_t column = 0;
    for (int64_t p = 0; p < args.part_count; ++p) {
      const AmxInputPart& part = args.parts[p];
      for (int64_t m = full_rows; m < M; ++m) {
        std::memcpy(scratch.tail_rows + (m - full_rows) * K + column, part.x + m * part.stride,
                    sizeof(uint16_t) * part.width);
      }
      column += part.width;
    }
  }

  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  constexpr int64_t kRowBlock = kAmxRowBlock, kColumnBlock = kAmxColumnBlock, kDepthBlock = kAmxDepthBlock;
  float* const sums = scratch.sums;  // [kRowBlock, kColumnBlock] fp32: one block of y across the K loop
  constexpr int64_t sums_stride_bytes = kColumnBlock * sizeof(float);
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m_count = M - m0 < kRowBlock ? M - m0 : kRowBlock;
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kColumnBlock) {
      const int64_t n_count = n_end - n0 < kColumnBlock ? n_end - n0 : kColumnBlock;
      // K in steps of up to kDepthBlock, each within one part.
      int64_t part_begin = 0;
      for (int64_t p = 0; p < args.part_count; part_begin += args.parts[p].width, ++p) {
        const AmxInputPart& part = args.parts[p];
        const int64_t part_end = part_begin + part.width;
        for (int64_t k0 = part_begin; k0 < part_end; k0 += kDepthBlock) {
          const int64_t steps = (part_end - k0 < kDepthBlock ? part_end - k0 : kDepthBlock) / 32;
          for (int64_t mm = 0; mm < m_count; mm += 32) {
            // 32 rows of x from k0: in place, or the padded tail.
            const bool tail = m0 + mm + 32 > M;
            const uint16_t* x_rows =
                tail ? scratch.tail_rows + k0 : part.x + (m0 + mm) * part.stride + (k0 - part_begin);
            const int64_t x_stride = tail ? K : part.stride;
            const int64_t x_stride_bytes = x_stride * int64_t(sizeof(uint16_t));
            for (int64_t nn = 0; nn < n_count; nn += 32) {
              float* c = sums + mm * kColumnBlock + nn;
              if (k0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
              } else {
                _tile_loadd(0, c, sums_stride_bytes);
                _tile_loadd(1, c + 16, sums_stride_bytes);
                _tile_loadd(2, c + 16 * kColumnBlock, sums_stride_bytes);
                _tile_loadd(3, c + 16 * kColumnBlock + 16, sums_stride_bytes);
              }
              const uint32_t* w0 = scratch.packed_w + (((n0 - n_begin + nn) / 16) * k_steps + k0 / 32) * 256;
              const uint32_t* w1 = w0 + k_steps * 256;
              // Each product issued as soon as its two tiles are in.
              for (int64_t s = 0; s < steps; ++s) {
                _tile_loadd(4, x_rows + 32 * s, x_stride_bytes);
                _tile_loadd(6, w0 + 256 * s, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, w1 + 256 * s, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, x_rows + 16 * x_stride + 32 * s, x_stride_bytes);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
              }
              _tile_stored(0, c, sums_stride_bytes);
              _tile_stored(1, c + 16, sums_stride_bytes);
              _tile_stored(2, c + 16 * kColumnBlock, sums_stride_bytes);
              _tile_stored(3, c + 16 * kColumnBlock + 16, sums_stride_bytes);
            }
          }
        }
      }
      // y = sums + bias, rounded once to bf16 (to nearest even, as at::linear's).
      for (int64_t m = 0; m < m_count; ++m) {
        const float* row = sums + m * kColumnBlock;
        uint16_t* out = args.y + (m0 + m) * args.y_stride + n0;
        for (int64_t n = 0; n < n_count; n += 16) {
          __m512 v = _mm512_loadu_ps(row + n);
          if (args.bias != nullptr) v = _mm512_add_ps(v, bf16x16_to_float(args.bias + n0 + n));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
        }
      }
    }
  }
  _tile_release();
}

}  // namespace shardit::nn::cpu

#else

namespace shardit::nn::cpu {
bool amx_gemm_kernel_built() { return false; }
void amx_bf16_linear_columns(const AmxLinearArgs&, int64_t, int64_t, const AmxScratch&) {}
}  // namespace shardit::nn::cpu

#endif
