// The AVX512-BF16 products of the bf16 attention (nn/cpu/bf16_attention.h), for CPUs with
// AVX512-BF16 and no AMX (AMD's Zen 4 and later, Intel's Cooper Lake): vdpbf16ps multiplies 16
// pairs of bf16 and adds both products to 16 fp32 sums. Compiled with the AVX-512 and
// AVX512-BF16 -m flags and called only on a CPU that has them; the blocks, softmax and merge around
// the products are bf16_attention_blocks.h. Raw pointers and C library calls only (see
// amx_gemm_kernel.cpp for why).
//
// Why not two library products per head (memory_efficient): at head size 128 q k^T has a depth of
// 128 and p v a width of 128, shapes on which the library's bf16 GEMM runs at half its rate, and
// each head's scores leave L2 between the products and the softmax passes.
#include "shardit/nn/cpu/bf16_attention_kernel.h"

#ifndef SHARDIT_AVX512_BF16_KERNELS_OFF
#include "shardit/nn/cpu/bf16_attention_blocks.h"

namespace shardit::nn::cpu {

namespace {

using namespace attention_blocks;

/// The 32-bit word at p (a pair of bf16) in every lane.
static inline __m512bh broadcast_pair(const uint16_t* p) {
  uint32_t word;
  memcpy(&word, p, sizeof(word));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(word)));
}

static inline __m512bh load_pairs(const uint32_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

/// sums [8 rows, 32 columns] (rows `sums_stride` floats apart) = sum over `pairs` steps i of the
/// rows' pair i (a: rows a_stride apart, pairs consecutive) times the second operand's pair row i:
/// 16 columns at pair_row(i), the next 16 `second_half` words further. 16 fp32 sums in
/// registers; each step one vdpbf16ps per sum, the steps in order.
template <class PairRow>
static inline void product_8x32(const uint16_t* a, int64_t a_stride, int64_t pairs, PairRow pair_row, int64_t second_half,
                         float* sums, int64_t sums_stride) {
  __m512 acc[8][2];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const uint32_t* b = pair_row(i);
    const __m512bh b0 = load_pairs(b), b1 = load_pairs(b + second_half);
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      const __m512bh x = broadcast_pair(a + r * a_stride + 2 * i);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    _mm512_storeu_ps(sums + r * sums_stride, acc[r][0]);
    _mm512_storeu_ps(sums + r * sums_stride + 16, acc[r][1]);
  }
}

struct Avx512Bf16Products {
  static constexpr bool kOverlapValues = false;

  /// scratch.scores [32, chunk width] = the block's rows of q times the chunk's keys, 32 keys at a
  /// time for every 8 rows, each step's maxima taken while its scores are in L1.
  static void scores(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch, const KeyChunk& keys,
                     RowBlock& block) {
    const int64_t D = args.head_dim, d_steps = D / 32, width = keys.width();
    int64_t q_stride = 0;
    const uint16_t* q_rows = block_q_rows(args, scratch, block, q_stride);
    RowMaxima maxima;
    for (int64_t n0 = keys.begin; n0 < keys.end; n0 += 32) {
      // Pair i of the head dimensions is row i % 16 of key block (n0 / 16, i / 16); the next 16
      // keys' blocks are d_steps * 256 words further (bf16_attention_blocks.h).
      const uint32_t* k0 = scratch.packed_k + (n0 / 16) * d_steps * 256;
      for (int64_t r0 = 0; r0 < block.rows; r0 += 8) {
        product_8x32(q_rows + r0 * q_stride, q_stride, D / 2,
                     [k0](int64_t i) { return k0 + (i / 16) * 256 + (i % 16) * 16; }, d_steps * 256,
                     scratch.scores + r0 * width + (n0 - keys.begin), width);
      }
      maxima.reduce(args, scratch, keys, block, n0);
    }
    maxima.finish(block);
  }

  /// scratch.sums [32, D] = the block's weights times the chunk's values, 8 rows and 32 head
  /// dimensions at a time over every key of the chunk in order; in one step.
  class Values {
   public:
    Values(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch, const KeyChunk& keys,
           const RowBlock& block)
        : args_(args), scratch_(scratch), keys_(keys), block_(block) {}

    int64_t total_steps() const { return 1; }

    void advance(int64_t steps) {
      if (steps <= 0 || done_) return;
      done_ = true;
      const int64_t D = args_.head_dim, d_blocks = D / 16, width = keys_.width();
      const uint32_t* first = scratch_.packed_v + (keys_.begin / 32) * d_blocks * 256;
      for (int64_t r0 = 0; r0 < block_.rows; r0 += 8) {
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
          // Key pair i of the chunk: row i % 16 of value block (i / 16, d0 / 16); the next 16
          // head dimensions are the following block, 256 words further.
          const uint32_t* v = first + (d0 / 16) * 256;
          product_8x32(block_.probs + r0 * width, width, width / 2,
                       [v, d_blocks](int64_t i) { return v + (i / 16) * d_blocks * 256 + (i % 16) * 16; }, 256,
                       scratch_.sums + r0 * D + d0, D);
        }
      }
    }

   private:
    const Bf16AttentionArgs& args_;
    const Bf16AttentionScratch& scratch_;
    const KeyChunk& keys_;
    const RowBlock& block_;
    bool done_ = false;
  };
};

}  // namespace

bool avx512_bf16_attention_kernel_built() { return true; }

void avx512_bf16_attention_pack(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch) {
  pack_keys_and_values(args, scratch);
}

void avx512_bf16_attention_rows(const Bf16AttentionArgs& args, int64_t q_begin, int64_t q_end,
                                const Bf16AttentionScratch& scratch) {
  attention_rows<Avx512Bf16Products>(args, q_begin, q_end, scratch, kAvx512Bf16AttentionBlocking);
}

}  // namespace shardit::nn::cpu

#else

namespace shardit::nn::cpu {
bool avx512_bf16_attention_kernel_built() { return false; }
void avx512_bf16_attention_pack(const Bf16AttentionArgs&, const Bf16AttentionScratch&) {}
void avx512_bf16_attention_rows(const Bf16AttentionArgs&, int64_t, int64_t, const Bf16AttentionScratch&) {}
}  // namespace shardit::nn::cpu

#endif
