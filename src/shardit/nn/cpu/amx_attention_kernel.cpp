// The AMX tile products of the bf16 attention (nn/cpu/bf16_attention.h), compiled with the AMX and
// AVX-512 -m flags and called only on a CPU that has them; the blocks, softmax and merge around
// them are bf16_attention_blocks.h. Raw pointers, C library calls and no library templates or
// inline library functions here (see amx_gemm_kernel.cpp for why).
#include "shardit/nn/cpu/bf16_attention_kernel.h"

#ifndef SHARDIT_AMX_KERNELS_OFF
#include "shardit/nn/cpu/amx_tiles.h"
#include "shardit/nn/cpu/bf16_attention_blocks.h"

namespace shardit::nn::cpu {

namespace {

using namespace attention_blocks;

struct AmxProducts {
  static constexpr bool kOverlapValues = true;

  /// scratch.scores [32, chunk width] = the block's 32 rows of q times the chunk's keys (fp32, on
  /// the tiles, 32 keys at a time); the vector units mask and reduce one step of keys while the
  /// tiles compute the next.
  static void scores(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch, const KeyChunk& keys,
                     RowBlock& block) {
    const int64_t d_steps = args.head_dim / 32, width = keys.width();
    int64_t q_stride = 0;
    const uint16_t* q_rows = block_q_rows(args, scratch, block, q_stride);
    const int64_t q_stride_bytes = q_stride * int64_t(sizeof(uint16_t));
    RowMaxima maxima;
    for (int64_t n0 = keys.begin; n0 < keys.end; n0 += 32) {
      amx::zero_sums_2x2();
      const uint32_t* k0 = scratch.packed_k + (n0 / 16) * d_steps * 256;
      const uint32_t* k1 = k0 + d_steps * 256;
      for (int64_t s = 0; s < d_steps; ++s) {
        amx::multiply_accumulate_2x2(q_rows + 32 * s, q_stride_bytes, k0 + 256 * s, k1 + 256 * s);
      }
      if (n0 > keys.begin) maxima.reduce(args, scratch, keys, block, n0 - 32);
      amx::store_sums_2x2(scratch.scores + (n0 - keys.begin), width);
    }
    maxima.reduce(args, scratch, keys, block, keys.end - 32);
    maxima.finish(block);
  }

  /// The product of a block's weights with the chunk's values, scratch.sums [32, D] fp32, 32 head
  /// dimensions at a time with the keys in one fixed order, run in pieces (`advance`) so that its
  /// tile products overlap the next block's softmax: the tiles work while the vector units do.
  class Values {
   public:
    Values(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch, const KeyChunk& keys,
           const RowBlock& block)
        : scratch_(scratch),
          probs_(block.probs),
          head_dim_(args.head_dim),
          width_(keys.width()),
          first_step_(keys.begin / 32),
          key_steps_(keys.width() / 32) {}

    /// Steps of 32 keys in all (each four tile products).
    int64_t total_steps() const { return head_dim_ / 32 * key_steps_; }

    /// Runs up to `steps` more steps.
    void advance(int64_t steps) {
      const int64_t probs_stride_bytes = width_ * int64_t(sizeof(uint16_t));
      const int64_t d_blocks = head_dim_ / 16;
      for (; steps > 0 && d0_ < head_dim_; --steps) {
        if (t_ == 0) amx::zero_sums_2x2();
        const uint32_t* v0 = scratch_.packed_v + ((first_step_ + t_) * d_blocks + d0_ / 16) * 256;
        amx::multiply_accumulate_2x2(probs_ + 32 * t_, probs_stride_bytes, v0, v0 + 256);
        if (++t_ == key_steps_) {
          amx::store_sums_2x2(scratch_.sums + d0_, head_dim_);
          d0_ += 32;
          t_ = 0;
        }
      }
    }

   private:
    const Bf16AttentionScratch& scratch_;
    const uint16_t* probs_;
    int64_t head_dim_, width_, first_step_, key_steps_;
    int64_t d0_ = 0, t_ = 0;
  };
};

}  // namespace

void amx_attention_pack(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch) {
  pack_keys_and_values(args, scratch);
}

void amx_attention_rows(const Bf16AttentionArgs& args, int64_t q_begin, int64_t q_end,
                        const Bf16AttentionScratch& scratch) {
  amx::load_full_tiles();
  attention_rows<AmxProducts>(args, q_begin, q_end, scratch, kAmxAttentionBlocking);
  _tile_release();
}

}  // namespace shardit::nn::cpu

#else

namespace shardit::nn::cpu {
void amx_attention_pack(const Bf16AttentionArgs&, const Bf16AttentionScratch&) {}
void amx_attention_rows(const Bf16AttentionArgs&, int64_t, int64_t, const Bf16AttentionScratch&) {}
}  // namespace shardit::nn::cpu

#endif
