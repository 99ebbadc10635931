// The AMX tile loops of nn/cpu/amx_gemm.h, compiled with the AMX and AVX-512 -m flags and called
// only on a CPU that has them. Raw pointers and no library templates here: an inline function
// instantiated in a translation unit with these flags could be the copy the linker keeps for the
// whole program, and would then fault on CPUs without them.
#include "shardit/nn/cpu/amx_gemm_kernel.h"

#ifndef SHARDIT_AMX_KERNELS_OFF
#include <cstring>

#include "shardit/nn/cpu/amx_tiles.h"
#include "shardit/nn/cpu/avx512_math.h"

namespace shardit::nn::cpu {

bool amx_gemm_kernel_built() { return true; }

void amx_bf16_linear_columns(const AmxLinearArgs& args, int64_t n_begin, int64_t n_end, const AmxScratch& scratch) {
  const int64_t K = args.in, M = args.rows;
  const int64_t k_steps = K / 32;
  // Column blocks of 16 of w[n_begin, n_end) packed once for every row block: tile (b, s) at
  // packed + (b * k_steps + s) * 256.
  for (int64_t block = 0; block < (n_end - n_begin) / 16; ++block) {
    const uint16_t* rows = args.w + (n_begin + 16 * block) * args.w_stride;
    for (int64_t s = 0; s < k_steps; ++s) {
      pairs::transpose_16x16_pairs(rows + 32 * s, args.w_stride, scratch.packed_w + (block * k_steps + s) * 256);
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

  amx::load_full_tiles();
  constexpr int64_t kRowBlock = kAmxRowBlock, kColumnBlock = kAmxColumnBlock, kDepthBlock = kAmxDepthBlock;
  float* const sums = scratch.sums;  // [kRowBlock, kColumnBlock] fp32: one block of y across the K loop
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
                amx::zero_sums_2x2();
              } else {
                amx::load_sums_2x2(c, kColumnBlock);
              }
              const uint32_t* w0 = scratch.packed_w + (((n0 - n_begin + nn) / 16) * k_steps + k0 / 32) * 256;
              const uint32_t* w1 = w0 + k_steps * 256;
              for (int64_t s = 0; s < steps; ++s) {
                amx::multiply_accumulate_2x2(x_rows + 32 * s, x_stride_bytes, w0 + 256 * s, w1 + 256 * s);
              }
              amx::store_sums_2x2(c, kColumnBlock);
            }
          }
        }
      }
      // y = sums + bias (through GELU when asked), rounded once to bf16 (to nearest even, as
      // at::linear's).
      for (int64_t m = 0; m < m_count; ++m) {
        const float* row = sums + m * kColumnBlock;
        uint16_t* out = args.y + (m0 + m) * args.y_stride + n0;
        for (int64_t n = 0; n < n_count; n += 16) {
          __m512 v = _mm512_loadu_ps(row + n);
          if (args.bias != nullptr) v = _mm512_add_ps(v, pairs::bf16x16_to_float(args.bias + n0 + n));
          if (args.gelu_tanh) v = avx512::gelu_tanh(v);
          pairs::store_bf16x16(out + n, v);
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
