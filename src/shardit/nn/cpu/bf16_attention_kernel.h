#pragma once
// The raw-pointer interface between nn/cpu/bf16_attention.cpp (tensors, checks, threads) and the
// kernels' translation units, each built with its own -m flags: amx_attention_kernel.cpp (AMX
// tiles) and avx512_bf16_attention_kernel.cpp (AVX512-BF16's vdpbf16ps). Only <cstdint> here: a
// kernel's translation unit must not instantiate library templates.
#include <cstdint>

namespace shardit::nn::cpu {

/// The kernels of the bf16 attention: the same blocks, softmax and merge (bf16_attention_blocks.h),
/// the products on AMX tiles or on AVX512-BF16's pair dot products.
enum class Bf16AttentionKernel { amx, avx512_bf16 };

/// One head: out[s_q, D] = softmax(scale q k^T) v, lse[s_q] = log sum_j exp(scale q k_j), every
/// matrix bf16 as raw bits with rows `*_stride` elements apart (the last dimension contiguous).
/// head_dim is a multiple of 32; strides are even. mask: bool [s_q or 1, s_kv], rows mask_stride
/// apart (0: one row for every query), or nullptr.
struct Bf16AttentionArgs {
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

/// The keys padded to a multiple of 32 (the products' step).
static inline int64_t attention_padded_keys(int64_t s_kv) { return (s_kv + 31) / 32 * 32; }

/// Blocking (fixed per kernel, so the order of every sum is too). Keys are taken key_chunk at a
/// time: a chunk's laid-out keys and values stay in L2 while every query block of a group of
/// row_group blocks of 32 rows runs over them, and the chunks' partial results merge by the online
/// softmax.
struct Bf16AttentionBlocking {
  int64_t key_chunk = 0;
  int64_t row_group = 0;
};

/// AMX: 768 KiB of keys and values at head size 128 (the Xeons' L2 is 2 MiB). Measured on FLUX's
/// 24 heads of 4608 queries: 1,650-1,725 GFLOP/s over 1024-2048 keys, 1,017 over all 4608 at once
/// (the keys and values then stream from L3).
constexpr Bf16AttentionBlocking kAmxAttentionBlocking{1536, 8};
/// AVX512-BF16: 512 KiB of keys and values at head size 128, with a block's scores and weights
/// under a 1 MiB L2 (AMD's Zen 4). 512 and 1024 keys measured alike there (FLUX's 24 heads of
/// 1536 and 4608 queries).
constexpr Bf16AttentionBlocking kAvx512Bf16AttentionBlocking{1024, 8};

static inline Bf16AttentionBlocking attention_blocking(Bf16AttentionKernel kernel) {
  return kernel == Bf16AttentionKernel::amx ? kAmxAttentionBlocking : kAvx512Bf16AttentionBlocking;
}

/// The width of one chunk's rows of scores and weights: min(key_chunk, padded keys).
static inline int64_t attention_chunk_keys(int64_t s_kv, const Bf16AttentionBlocking& blocking) {
  const int64_t padded = attention_padded_keys(s_kv);
  return padded < blocking.key_chunk ? padded : blocking.key_chunk;
}

/// One thread's buffers, 64-byte aligned, for P = attention_padded_keys(s_kv), C =
/// attention_chunk_keys(s_kv, blocking), G = blocking.row_group and D = head_dim: packed_k and
/// packed_v P * D / 2 words each, scores 32 * C floats, probs 2 * 32 * C values (two blocks in
/// flight), sums 32 * D floats, rows 32 * D values, and for a group of G blocks of 32 rows the
/// merged results: merged G * 32 * D floats, merged_max and merged_sum G * 32 floats each.
struct Bf16AttentionScratch {
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

// Each kernel's pair: callers check that the kernel is available (bf16_attention.h) first; the AMX
// one is built under the same condition as the AMX GEMM (src/shardit/CMakeLists.txt), the
// AVX512-BF16 one where the compiler has -mavx512bf16.

/// Lays out k and v of the head in `args` in the pair layout of the products (q k^T reads the keys
/// as its second operand, p v the values), zero-padded to attention_padded_keys(s_kv) keys.
/// Whether avx512_bf16_attention_kernel.cpp was built with its -m flags (the compiler has them).
bool avx512_bf16_attention_kernel_built();

void amx_attention_pack(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch);
void avx512_bf16_attention_pack(const Bf16AttentionArgs& args, const Bf16AttentionScratch& scratch);

/// Query rows [q_begin, q_end) of the head (q_begin a multiple of 32), after the pack: for each
/// block of 32 rows and chunk of keys, the scores (fp32 sums), each row's softmax over the chunk
/// (fp32 on the vector units; weights exp(scale (s - max)) rounded to bf16), the product of the
/// weights with the values (fp32 sums); the chunks' results merged by their maxima, divided by the
/// row's fp32 sum and rounded once to bf16. Each row's result depends on nothing but its own
/// inputs, in one fixed order, so every split of the rows between threads gives the same bits.
/// AMX: the products on the tiles, a block's product with the values while the next block's
/// softmax runs on the vector units.
void amx_attention_rows(const Bf16AttentionArgs& args, int64_t q_begin, int64_t q_end,
                        const Bf16AttentionScratch& scratch);
/// AVX512-BF16: the products as vdpbf16ps on 8 rows x 32 columns of fp32 sums in registers.
void avx512_bf16_attention_rows(const Bf16AttentionArgs& args, int64_t q_begin, int64_t q_end,
                                const Bf16AttentionScratch& scratch);

}  // namespace shardit::nn::cpu
