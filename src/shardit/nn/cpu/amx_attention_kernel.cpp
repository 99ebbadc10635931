// The AMX tile loops of nn/cpu/amx_attention.h, compiled with the AMX and AVX-512 -m flags and
// called only on a CPU that has them. Raw pointers, C library calls and no library templates or
// inline library functions here (see amx_gemm_kernel.cpp for why).
#include "shardit/nn/cpu/amx_attention_kernel.h"

#ifndef SHARDIT_AMX_KERNELS_OFF
#include <math.h>
#include <string.h>

#include "shardit/nn/cpu/amx_tiles.h"
#include "shardit/nn/cpu/avx512_math.h"

namespace shardit::nn::cpu {

void amx_attention_pack(const AmxAttentionArgs& args, const AmxAttentionScratch& scratch) {
  const int64_t D = args.head_dim, s_kv = args.s_kv, padded = amx_padded_keys(s_kv);
  const int64_t d_steps = D / 32, d_blocks = D / 16;
  // Keys, the columns of q k^T: tile (b, s) holds keys [16b, 16b + 16) over head dimensions
  // [32s, 32s + 32), at packed_k + (b * d_steps + s) * 256. The last keys are zero-padded to 16.
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
      amx::transpose_16x16_u32(reinterpret_cast<const uint32_t*>(keys + 32 * s), stride / 2,
                               scratch.packed_k + (b * d_steps + s) * 256);
    }
  }
  // Values, the second operand of p v, whose depth is the keys: tile (t, c) holds keys
  // [32t, 32t + 32) over head dimensions [16c, 16c + 16), at packed_v + (t * d_blocks + c) * 256;
  // its row r pairs key 32t + 2r (low half) with key 32t + 2r + 1 (high half). Missing keys are 0.
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < padded / 32; ++t) {
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t even = 32 * t + 2 * r, odd = even + 1;
      const uint16_t* even_row = even < s_kv ? args.v + even * args.v_stride : nullptr;
      const uint16_t* odd_row = odd < s_kv ? args.v + odd * args.v_stride : nullptr;
      for (int64_t c = 0; c < d_blocks; ++c) {
        const __m512i low =
            even_row != nullptr ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even_row + 16 * c)))
                        : zero;
        const __m512i high =
            odd_row != nullptr ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd_row + 16 * c)))
                       : zero;
        _mm512_storeu_si512(scratch.packed_v + (t * d_blocks + c) * 256 + 16 * r,
                            _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
      }
    }
  }
}

namespace {

constexpr float kNegInf = -__builtin_inff();

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

/// The allowed keys among [k0, k0 + 32) for one query row, as bits: keys below s_kv, and those
/// its mask row (nullptr: none) lets through. Reads no mask byte past s_kv.
inline __mmask32 allowed_keys(const bool* mask_row, int64_t k0, int64_t s_kv) {
  const __mmask32 valid = s_kv - k0 >= 32 ? ~__mmask32{0} : (__mmask32{1} << (s_kv - k0)) - 1;
  if (mask_row == nullptr) return valid;
  const __m256i bytes = _mm256_maskz_loadu_epi8(valid, mask_row + k0);
  return _mm256_mask_cmpneq_epi8_mask(valid, bytes, _mm256_setzero_si256());
}

/// scratch.scores [32, chunk width] = the block's 32 rows of q times the chunk's keys (fp32, on
/// the tiles, 32 keys at a time), with each key a row may not see (masked or padding) set to
/// -inf, and the rows' maxima: the vector units reduce one step of keys while the tiles compute
/// the next.
void block_scores(const AmxAttentionArgs& args, const AmxAttentionScratch& scratch, const KeyChunk& keys,
                  RowBlock& block) {
  const int64_t D = args.head_dim, s_kv = args.s_kv, width = keys.width(), d_steps = D / 32;
  // 32 rows of q: in place, or the last ones zero-padded (a tile load reads 16 rows).
  const uint16_t* q_rows = args.q + block.m0 * args.q_stride;
  int64_t q_stride = args.q_stride;
  if (block.rows < 32) {
    memset(scratch.rows, 0, sizeof(uint16_t) * 32 * D);
    for (int64_t r = 0; r < block.rows; ++r) {
      memcpy(scratch.rows + r * D, args.q + (block.m0 + r) * args.q_stride, sizeof(uint16_t) * D);
    }
    q_rows = scratch.rows;
    q_stride = D;
  }
  const int64_t q_stride_bytes = q_stride * int64_t(sizeof(uint16_t));

  __m512 maxima[32];
  __mmask16 nan_seen[32];
  for (int64_t r = 0; r < 32; ++r) {
    maxima[r] = _mm512_set1_ps(kNegInf);
    nan_seen[r] = 0;
  }
  const __m512 minus_inf = _mm512_set1_ps(kNegInf);
  // Keys [k0, k0 + 32) of every real row: the keys it may not see to -inf, the maximum updated.
  const auto reduce_keys = [&](int64_t k0) {
    const bool rewrite = args.mask != nullptr || k0 + 32 > s_kv;
    for (int64_t r = 0; r < block.rows; ++r) {
      float* row = scratch.scores + r * width + (k0 - keys.begin);
      __m512 low = _mm512_loadu_ps(row), high = _mm512_loadu_ps(row + 16);
      if (rewrite) {
        const bool* mask_row = args.mask == nullptr ? nullptr : args.mask + (block.m0 + r) * args.mask_stride;
        const __mmask32 allowed = allowed_keys(mask_row, k0, s_kv);
        low = _mm512_mask_blend_ps(static_cast<__mmask16>(allowed), minus_inf, low);
        high = _mm512_mask_blend_ps(static_cast<__mmask16>(allowed >> 16), minus_inf, high);
        _mm512_storeu_ps(row, low);
        _mm512_storeu_ps(row + 16, high);
      }
      nan_seen[r] |= _mm512_cmp_ps_mask(low, low, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(high, high, _CMP_UNORD_Q);
      maxima[r] = _mm512_max_ps(maxima[r], _mm512_max_ps(low, high));
    }
  };
  for (int64_t n0 = keys.begin; n0 < keys.end; n0 += 32) {
    amx::zero_sums_2x2();
    const uint32_t* k0 = scratch.packed_k + (n0 / 16) * d_steps * 256;
    const uint32_t* k1 = k0 + d_steps * 256;
    for (int64_t s = 0; s < d_steps; ++s) {
      amx::multiply_accumulate_2x2(q_rows + 32 * s, q_stride_bytes, k0 + 256 * s, k1 + 256 * s);
    }
    if (n0 > keys.begin) reduce_keys(n0 - 32);
    amx::store_sums_2x2(scratch.scores + (n0 - keys.begin), width);
  }
  reduce_keys(keys.end - 32);
  for (int64_t r = 0; r < block.rows; ++r) {
    block.row_max[r] = nan_seen[r] != 0 ? __builtin_nanf("") : _mm512_reduce_max_ps(maxima[r]);
  }
}

/// The product of a block's weights with the chunk's values, scratch.sums [32, D] fp32, 32 head
/// dimensions at a time with the keys in one fixed order, run in pieces (`advance`) so that its
/// tile products overlap the next block's softmax: the tiles work while the vector units do.
class ValuesProduct {
 public:
  ValuesProduct(const AmxAttentionArgs& args, const AmxAttentionScratch& scratch, const KeyChunk& keys,
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
  const AmxAttentionScratch& scratch_;
  const uint16_t* probs_;
  int64_t head_dim_, width_, first_step_, key_steps_;
  int64_t d0_ = 0, t_ = 0;
};

/// The block's weights over the chunk, exp(scale (s - max)) as bf16, unnormalised (0 for the keys
/// set to -inf), and their sums; padded rows weigh 0. `overlapped`, when given, advances one step
/// per `vectors_per_step` vectors of weights.
void block_weights(const AmxAttentionArgs& args, const AmxAttentionScratch& scratch, const KeyChunk& keys,
                   RowBlock& block, ValuesProduct* overlapped) {
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
      amx::store_bf16x16(probs + j, e);
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
void block_merge(const AmxAttentionArgs& args, const AmxAttentionScratch& scratch, const RowBlock& block,
                 bool first_chunk, const MergedRows& merged) {
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
void block_output(const AmxAttentionArgs& args, int64_t m0, int64_t rows, const MergedRows& merged) {
  const int64_t D = args.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = merged.sum[r], max = merged.max[r];
    const __m512 divisor = _mm512_set1_ps(sum == 0.0f ? 1.0f : sum);
    uint16_t* out = args.out + (m0 + r) * args.out_stride;
    for (int64_t n = 0; n < D; n += 16) {
      amx::store_bf16x16(out + n, _mm512_div_ps(_mm512_loadu_ps(merged.sums + r * D + n), divisor));
    }
    args.lse[m0 + r] = (max == kNegInf ? kNegInf : args.scale * max) + logf(sum);
  }
}

}  // namespace

void amx_attention_rows(const AmxAttentionArgs& args, int64_t q_begin, int64_t q_end,
                        const AmxAttentionScratch& scratch) {
  const int64_t padded = amx_padded_keys(args.s_kv), chunk = amx_chunk_keys(args.s_kv), D = args.head_dim;
  // Two blocks in flight: while block i's weights are computed on the vector units, block
  // i - 1's product with the values runs on the tiles in steps between them.
  RowBlock blocks[2];
  blocks[0].probs = scratch.probs;
  blocks[1].probs = scratch.probs + 32 * chunk;
  const auto merged_rows = [&](int64_t block_in_group) {
    return MergedRows{scratch.merged + block_in_group * 32 * D, scratch.merged_max + block_in_group * 32,
                      scratch.merged_sum + block_in_group * 32};
  };
  amx::load_full_tiles();
  for (int64_t g0 = q_begin; g0 < q_end; g0 += 32 * kAmxRowGroup) {
    const int64_t g1 = q_end - g0 < 32 * kAmxRowGroup ? q_end : g0 + 32 * kAmxRowGroup;
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
        block_scores(args, scratch, keys, block);
        if (previous == nullptr) {
          block_weights(args, scratch, keys, block, nullptr);
        } else {
          ValuesProduct product(args, scratch, keys, *previous);
          block_weights(args, scratch, keys, block, &product);
          product.advance(product.total_steps());
          block_merge(args, scratch, *previous, first_chunk, merged_rows(previous_index));
        }
        previous = &block;
        previous_index = index;
      }
      ValuesProduct product(args, scratch, keys, *previous);
      product.advance(product.total_steps());
      block_merge(args, scratch, *previous, first_chunk, merged_rows(previous_index));
    }
    for (int64_t m0 = g0, index = 0; m0 < g1; m0 += 32, ++index) {
      block_output(args, m0, g1 - m0 < 32 ? g1 - m0 : 32, merged_rows(index));
    }
  }
  _tile_release();
}

}  // namespace shardit::nn::cpu

#else

namespace shardit::nn::cpu {
void amx_attention_pack(const AmxAttentionArgs&, const AmxAttentionScratch&) {}
void amx_attention_rows(const AmxAttentionArgs&, int64_t, int64_t, const AmxAttentionScratch&) {}
}  // namespace shardit::nn::cpu

#endif
