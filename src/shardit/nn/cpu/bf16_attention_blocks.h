#pragma once
// What the bf16 attention kernels (amx_attention_kernel.cpp, avx512_bf16_attention_kernel.cpp)
// share around their products: the pair layout of the keys and values, the masking and maxima of a
// block's scores, the softmax weights, the online-softmax merge of the key chunks, the output and
// the driver that walks the blocks. A kernel supplies the two products (see attention_rows).
// Include only from translation units built with AVX-512F and AVX512-BF16; everything is static,
// so each keeps its own copy under its own flags.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "shardit/nn/cpu/avx512_math.h"
#include "shardit/nn/cpu/bf16_attention_kernel.h"
#include "shardit/nn/cpu/bf16_pairs.h"

namespace shardit::nn::cpu::attention_blocks {

constexpr float kNegInf = -__builtin_inff();

/// Lays out the head's keys and values in the pair layout, zero-padded to 32 keys.
/// Keys, the columns of q k^T: block (b, s) holds keys [16b, 16b + 16) over head dimensions
/// [32s, 32s + 32), 16 rows of 16 words at packed_k + (b * D / 32 + s) * 256; row r holds the
/// keys' pairs of dimensions 32s + 2r, 32s + 2r + 1.
/// Values, the second operand of p v, whose depth is the keys: block (t, c) holds keys
/// [32t, 32t + 32) over head dimensions [16c, 16c + 16), at packed_v + (t * D / 16 + c) * 256; its
/// row r pairs key 32t + 2r (low half) with key 32t + 2r + 1 (high half).
static inline void pack_keys_and_values(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch) {
  const int64_t D = args.head_dim, s_kv = args.s_kv, padded = attention_padded_keys(s_kv);
  const int64_t d_steps = D / 32, d_blocks = D / 16;
  for (int64_t b = 0; b < padded / 16; ++b) {
    const uint16_t* keys = args.k + 16 * b * args.k_stride;
    int64_t stride = args.k_stride;
    if (16 * b + 16 > s_kv) {
      memset(scratch.rows, 0, sizeof(uint16_t) * 16 * D);
      for (int64_t j = 16 * b; j < s_kv; ++j) {
        memcpy(scratch.rows + (j - 16 * b) * D, args.k + j * args.k_stride, sizeof(uint16_t) * D);
      }
      keys = scratch.rows;
      stride = D;
    }
    for (int64_t s = 0; s < d_steps; ++s) {
      pairs::transpose_16x16_pairs(keys + 32 * s, stride, scratch.packed_k + (b * d_steps + s) * 256);
    }
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < padded / 32; ++t) {
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t even = 32 * t + 2 * r, odd = even + 1;
      const uint16_t* even_row = even < s_kv ? args.v + even * args.v_stride : nullptr;
      const uint16_t* odd_row = odd < s_kv ? args.v + odd * args.v_stride : nullptr;
      for (int64_t c = 0; c < d_blocks; ++c) {
        const __m512i low =
            even_row != nullptr
                ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even_row + 16 * c)))
                : zero;
        const __m512i high =
            odd_row != nullptr
                ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd_row + 16 * c)))
                : zero;
        _mm512_storeu_si512(scratch.packed_v + (t * d_blocks + c) * 256 + 16 * r,
                            _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
      }
    }
  }
}

/// A chunk of the padded keys, [begin, end), multiples of 32.
struct KeyChunk {
  int64_t begin = 0, end = 0;
  int64_t width() const { return end - begin; }
};

/// A block of 32 query rows on its way through one chunk of keys.
struct RowBlock {
  int64_t m0 = 0, rows = 0;
  uint16_t* probs = nullptr;  // [32, chunk width] bf16 weights
  float row_max[32];          // the maximum of each row's allowed scores in the chunk (unscaled; NaN wins)
  float row_sum[32];          // the sum of each row's weights in the chunk
};

/// The block's 32 rows of q: in place, or the last ones zero-padded in scratch.rows (the products
/// read 32 rows). Sets `stride` to the rows' distance in elements.
static inline const uint16_t* block_q_rows(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch,
                                           const RowBlock& block, int64_t& stride) {
  stride = args.q_stride;
  if (block.rows == 32) return args.q + block.m0 * args.q_stride;
  const int64_t D = args.head_dim;
  memset(scratch.rows, 0, sizeof(uint16_t) * 32 * D);
  for (int64_t r = 0; r < block.rows; ++r) {
    memcpy(scratch.rows + r * D, args.q + (block.m0 + r) * args.q_stride, sizeof(uint16_t) * D);
  }
  stride = D;
  return scratch.rows;
}

/// The allowed keys among [k0, k0 + 32) for one query row, as bits: keys below s_kv, and those
/// its mask row (nullptr: none) lets through. Reads no mask byte past s_kv.
static inline __mmask32 allowed_keys(const bool* mask_row, int64_t k0, int64_t s_kv) {
  const __mmask32 valid = s_kv - k0 >= 32 ? ~__mmask32{0} : (__mmask32{1} << (s_kv - k0)) - 1;
  if (mask_row == nullptr) return valid;
  const __m256i bytes = _mm256_maskz_loadu_epi8(valid, mask_row + k0);
  return _mm256_mask_cmpneq_epi8_mask(valid, bytes, _mm256_setzero_si256());
}

/// The maxima of a block's rows over a chunk's scores (scratch.scores [32, chunk width]), taken
/// 32 keys at a time as the scores come in; the keys a row may not see (masked or padding) are set
/// to -inf on the way.
class RowMaxima {
 public:
  RowMaxima() {
    for (int64_t r = 0; r < 32; ++r) {
      maxima_[r] = _mm512_set1_ps(kNegInf);
      nan_seen_[r] = 0;
    }
  }

  /// Keys [k0, k0 + 32) of every real row of the block.
  void reduce(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch, const KeyChunk& keys,
              const RowBlock& block, int64_t k0) {
    const __m512 minus_inf = _mm512_set1_ps(kNegInf);
    const bool rewrite = args.mask != nullptr || k0 + 32 > args.s_kv;
    const int64_t width = keys.width();
    for (int64_t r = 0; r < block.rows; ++r) {
      float* row = scratch.scores + r * width + (k0 - keys.begin);
      __m512 low = _mm512_loadu_ps(row), high = _mm512_loadu_ps(row + 16);
      if (rewrite) {
        const bool* mask_row = args.mask == nullptr ? nullptr : args.mask + (block.m0 + r) * args.mask_stride;
        const __mmask32 allowed = allowed_keys(mask_row, k0, args.s_kv);
        low = _mm512_mask_blend_ps(static_cast<__mmask16>(allowed), minus_inf, low);
        high = _mm512_mask_blend_ps(static_cast<__mmask16>(allowed >> 16), minus_inf, high);
        _mm512_storeu_ps(row, low);
        _mm512_storeu_ps(row + 16, high);
      }
      nan_seen_[r] |= _mm512_cmp_ps_mask(low, low, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(high, high, _CMP_UNORD_Q);
      maxima_[r] = _mm512_max_ps(maxima_[r], _mm512_max_ps(low, high));
    }
  }

  /// Each real row's maximum into block.row_max (NaN where a score was NaN).
  void finish(RowBlock& block) const {
    for (int64_t r = 0; r < block.rows; ++r) {
      block.row_max[r] = nan_seen_[r] != 0 ? __builtin_nanf("") : _mm512_reduce_max_ps(maxima_[r]);
    }
  }

 private:
  __m512 maxima_[32];
  __mmask16 nan_seen_[32];
};

/// The block's weights over the chunk, exp(scale (s - max)) as bf16, unnormalised (0 for the keys
/// set to -inf), and their sums; padded rows weigh 0. `overlapped`, when given, advances one step
/// per share of the vectors of weights, so that its products run between them.
template <class ValuesProduct>
static inline void block_weights(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch,
                                 const KeyChunk& keys, RowBlock& block, ValuesProduct* overlapped) {
  const int64_t width = keys.width();
  const int64_t vectors_per_step =
      overlapped == nullptr ? 0 : (32 * width / 16 + overlapped->total_steps() - 1) / overlapped->total_steps();
  int64_t vectors = 0;
  const __m512 scale_log2e = _mm512_set1_ps(args.scale * 1.4426950408889634f);
  for (int64_t r = 0; r < 32; ++r) {
    uint16_t* probs = block.probs + r * width;
    if (r >= block.rows) {
      memset(probs, 0, sizeof(uint16_t) * width);
      continue;
    }
    // A row with no allowed key (maximum -inf): shift by 0, so every weight is exp(-inf) = 0.
    const float shift = block.row_max[r] == kNegInf ? 0.0f : block.row_max[r];
    const __m512 shift_v = _mm512_set1_ps(shift);
    const float* scores = scratch.scores + r * width;
    __m512 sums = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 16) {
      const __m512 e =
          avx512::exp2_nonpositive(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + j), shift_v), scale_log2e));
      pairs::store_bf16x16(probs + j, e);
      sums = _mm512_add_ps(sums, e);
      if (overlapped != nullptr && ++vectors == vectors_per_step) {
        overlapped->advance(1);
        vectors = 0;
      }
    }
    block.row_sum[r] = _mm512_reduce_add_ps(sums);
  }
}

/// The rows of one query block, merged over the chunks: [32, D] fp32 sums and each row's maximum
/// (unscaled) and sum, all relative to that maximum.
struct MergedRows {
  float* sums;
  float* max;
  float* sum;
};

/// Folds a block's result over one chunk (scratch.sums, its maxima and sums) into `merged`: the
/// first chunk is copied; a later one rescales both sides to the larger maximum (the online
/// softmax). A row with no allowed key so far keeps 0; a NaN maximum spreads to the row.
static inline void block_merge(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch,
                               const RowBlock& block, bool first_chunk, const MergedRows& merged) {
  const int64_t D = args.head_dim;
  for (int64_t r = 0; r < block.rows; ++r) {
    float* out = merged.sums + r * D;
    const float* part = scratch.sums + r * D;
    if (first_chunk) {
      memcpy(out, part, sizeof(float) * D);
      merged.max[r] = block.row_max[r];
      merged.sum[r] = block.row_sum[r];
      continue;
    }
    const float old_max = merged.max[r], part_max = block.row_max[r];
    const float new_max = (old_max != old_max || part_max != part_max) ? __builtin_nanf("")
                          : old_max > part_max                        ? old_max
                                                                      : part_max;
    if (new_max == kNegInf) continue;  // every key so far masked: sums and sum stay 0
    const float old_scale = old_max == kNegInf ? 0.0f : expf(args.scale * (old_max - new_max));
    const float part_scale = part_max == kNegInf ? 0.0f : expf(args.scale * (part_max - new_max));
    const __m512 a = _mm512_set1_ps(old_scale), b = _mm512_set1_ps(part_scale);
    for (int64_t n = 0; n < D; n += 16) {
      _mm512_storeu_ps(out + n, _mm512_fmadd_ps(_mm512_loadu_ps(out + n), a,
                                                _mm512_mul_ps(_mm512_loadu_ps(part + n), b)));
    }
    merged.sum[r] = merged.sum[r] * old_scale + block.row_sum[r] * part_scale;
    merged.max[r] = new_max;
  }
}

/// out = merged sums / the row's sum, rounded once to bf16, and the rows' lse
/// (scale * max + log sum); a row with no allowed key gives 0 and -inf.
static inline void block_output(const Bf16AttentionArgs& args, int64_t m0, int64_t rows, const MergedRows& merged) {
  const int64_t D = args.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = merged.sum[r], max = merged.max[r];
    const __m512 divisor = _mm512_set1_ps(sum == 0.0f ? 1.0f : sum);
    uint16_t* out = args.out + (m0 + r) * args.out_stride;
    for (int64_t n = 0; n < D; n += 16) {
      pairs::store_bf16x16(out + n, _mm512_div_ps(_mm512_loadu_ps(merged.sums + r * D + n), divisor));
    }
    args.lse[m0 + r] = (max == kNegInf ? kNegInf : args.scale * max) + logf(sum);
  }
}

/// Query rows [q_begin, q_end) of the head, in groups of blocking.row_group blocks of 32 rows per
/// chunk of keys. Kernel supplies the products:
///   static void scores(args, scratch, keys, block): scratch.scores [32, chunk width] = the block's
///     rows of q times the chunk's keys (fp32), block.row_max from a RowMaxima;
///   class Values(args, scratch, keys, block) with total_steps() and advance(steps): scratch.sums
///     [32, D] = the block's weights times the chunk's values, in steps;
///   static constexpr bool kOverlapValues: whether a block's Values steps run between the next
///     block's weights (the products on other units than the softmax) or after its own.
template <class Kernel>
static inline void attention_rows(const Bf16AttentionArgs& args, int64_t q_begin, int64_t q_end,
                                  const Bf16AttentionScratch& scratch, const Bf16AttentionBlocking& blocking) {
  using Values = typename Kernel::Values;
  const int64_t padded = attention_padded_keys(args.s_kv), chunk = attention_chunk_keys(args.s_kv, blocking);
  const int64_t D = args.head_dim, group = 32 * blocking.row_group;
  // Two blocks in flight: with kOverlapValues, block i - 1's product with the values runs in steps
  // between block i's weights.
  RowBlock blocks[2];
  blocks[0].probs = scratch.probs;
  blocks[1].probs = scratch.probs + 32 * chunk;
  const auto merged_rows = [&](int64_t block_in_group) {
    return MergedRows{scratch.merged + block_in_group * 32 * D, scratch.merged_max + block_in_group * 32,
                      scratch.merged_sum + block_in_group * 32};
  };
  for (int64_t g0 = q_begin; g0 < q_end; g0 += group) {
    const int64_t g1 = q_end - g0 < group ? q_end : g0 + group;
    for (KeyChunk keys{0, chunk}; keys.begin < padded;
         keys = KeyChunk{keys.end, padded - keys.end < chunk ? padded : keys.end + chunk}) {
      const bool first_chunk = keys.begin == 0;
      RowBlock* previous = nullptr;
      int64_t previous_index = 0;
      int64_t index = 0;
      for (int64_t m0 = g0; m0 < g1; m0 += 32, ++index) {
        RowBlock& block = blocks[index % 2];
        block.m0 = m0;
        block.rows = g1 - m0 < 32 ? g1 - m0 : 32;
        Kernel::scores(args, scratch, keys, block);
        if constexpr (!Kernel::kOverlapValues) {
          block_weights<Values>(args, scratch, keys, block, nullptr);
          Values product(args, scratch, keys, block);
          product.advance(product.total_steps());
          block_merge(args, scratch, block, first_chunk, merged_rows(index));
          continue;
        }
        if (previous == nullptr) {
          block_weights<Values>(args, scratch, keys, block, nullptr);
        } else {
          Values product(args, scratch, keys, *previous);
          block_weights(args, scratch, keys, block, &product);
          product.advance(product.total_steps());
          block_merge(args, scratch, *previous, first_chunk, merged_rows(previous_index));
        }
        previous = &block;
        previous_index = index;
      }
      if (previous != nullptr) {
        Values product(args, scratch, keys, *previous);
        product.advance(product.total_steps());
        block_merge(args, scratch, *previous, first_chunk, merged_rows(previous_index));
      }
    }
    for (int64_t m0 = g0, index = 0; m0 < g1; m0 += 32, ++index) {
      block_output(args, m0, g1 - m0 < 32 ? g1 - m0 : 32, merged_rows(index));
    }
  }
}

}  // namespace shardit::nn::cpu::attention_blocks
