#pragma once
// The raw-pointer interface between nn/cpu/amx_attention.cpp (tensors, checks, threads) and
// nn/cpu/amx_attention_kernel.cpp (the tile loops, built with the AMX -m flags). Only <cstdint>
// here: the kernel's translation unit must not instantiate library templates.
#include <cstdint>

namespace shardit::nn::cpu {

/// One head: out[s_q, D] = softmax(scale q k^T) v, lse[s_q] = log sum_j exp(scale q k_j), every
/// matrix bf16 as raw bits with rows `*_stride` elements apart (the last dimension contiguous).
/// head_dim is a multiple of 32; strides are even. mask: bool [s_q or 1, s_kv], rows mask_stride
/// apart (0: one row for every query), or nullptr.
struct AmxAttentionArgs {
  const uint16_t* q = nullptr;
  int64_t q_stride = 0;
  const uint16_t* k = nullptr;
  int64_t k_stride = 0;
  const uint16_t* v = nullptr;
  int64_t v_stride = 0;
  const bool* mask = nullptr;
  int64_t mask_stride = 0;
  uint16_t* out = nullptr;
  int64_t out_stride = 0;
  float* lse = nullptr;
  int64_t s_q = 0, s_kv = 0, head_dim = 0;
  float scale = 1.0f;
};

/// The keys padded to a multiple of 32 (the tiles' step).
inline int64_t amx_padded_keys(int64_t s_kv) { return (s_kv + 31) / 32 * 32; }

// Blocking (fixed, so the order of every sum is too). Keys are taken kAmxKeyChunk at a time: a
// chunk's laid-out keys and values (768 KiB at head size 128) stay in L2 while every query block
// of a group of kAmxRowGroup blocks of 32 rows runs over them, and the chunks' partial results
// merge by the online softmax. Measured on FLUX's 24 heads of 4608 queries: 1,650-1,725 GFLOP/s
// over 1024-2048 keys, 1,017 over all 4608 at once (the keys and values then stream from L3).
constexpr int64_t kAmxKeyChunk = 1536;
constexpr int64_t kAmxRowGroup = 8;

/// The width of one chunk's rows of scores and weights: min(kAmxKeyChunk, padded keys).
inline int64_t amx_chunk_keys(int64_t s_kv) {
  const int64_t padded = amx_padded_keys(s_kv);
  return padded < kAmxKeyChunk ? padded : kAmxKeyChunk;
}

/// One thread's buffers, 64-byte aligned, for P = amx_padded_keys(s_kv), C = amx_chunk_keys(s_kv)
/// and D = head_dim: packed_k and packed_v P * D / 2 words each, scores 32 * C floats, probs
/// 2 * 32 * C values (two blocks in flight), sums 32 * D floats, rows 32 * D values, and for a
/// group of kAmxRowGroup blocks the merged results: merged kAmxRowGroup * 32 * D floats,
/// merged_max and merged_sum kAmxRowGroup * 32 floats each.
struct AmxAttentionScratch {
  uint32_t* packed_k = nullptr;
  uint32_t* packed_v = nullptr;
  float* scores = nullptr;
  uint16_t* probs = nullptr;
  float* sums = nullptr;
  uint16_t* rows = nullptr;
  float* merged = nullptr;
  float* merged_max = nullptr;
  float* merged_sum = nullptr;
};

// Built under the same condition as the GEMM kernel (src/shardit/CMakeLists.txt): callers check
// amx_gemm_available() before calling anything here.

/// Lays out k and v of the head in `args` in the pair layout of the tile products (q k^T reads the
/// keys as its second operand, p v the values), zero-padded to amx_padded_keys(s_kv) keys.
void amx_attention_pack(const AmxAttentionArgs& args, const AmxAttentionScratch& scratch);

/// Query rows [q_begin, q_end) of the head (q_begin a multiple of 32), after amx_attention_pack:
/// for each block of 32 rows and chunk of keys, the scores (fp32 on the tiles), each row's softmax
/// over the chunk (fp32 on the vector units; weights exp(scale (s - max)) rounded to bf16), the
/// product of the weights with the values (fp32 sums; on the tiles while the next block's softmax
/// runs); the chunks' results merged by their maxima, divided by the row's fp32 sum and rounded
/// once to bf16. Each row's result depends on nothing but its own inputs, in one fixed order, so
/// every split of the rows between threads gives the same bits.
void amx_attention_rows(const AmxAttentionArgs& args, int64_t q_begin, int64_t q_end,
                        const AmxAttentionScratch& scratch);

}  // namespace shardit::nn::cpu
