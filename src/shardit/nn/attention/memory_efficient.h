#pragma once
// Memory-efficient attention on any device LibTorch runs on: queries in blocks, and for each
// query block the keys and values streamed in blocks with an online softmax (running maximum and
// running sum, the partial output rescaled as the maximum grows). Scores exist one block at a
// time, so memory grows linearly with the sequence instead of with its square.
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace shardit::nn {

/// Block sizes of memory_efficient_attention, which runs one head at a time. 0: every key in one
/// block up to 8192 keys (blocks of 8192 beyond), and as many queries as keep one block of scores
/// ([query_block, key_block] fp32, one head) under `scores_budget_bytes`.
struct MemoryEfficientOptions {
  int64_t query_block = 0;
  int64_t key_block = 0;
  int64_t scores_budget_bytes = int64_t{4} << 20;
};

/// The attention output and the log-sum-exp of each query's scaled, masked scores: what ring
/// attention needs to merge partial results over key shards
/// (out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i).
struct AttentionWithLse {
  at::Tensor output;  ///< [B, H, S_q, D] in q's dtype
  at::Tensor lse;     ///< [B, H, S_q] fp32; -inf for a query whose keys are all masked
};

/// `mask` as a 4-D view broadcastable to [B, H, S_q, S_kv] (q [B, H, S_q, D], k [B, H, S_kv, D]),
/// or nullopt when it has more than 4 dimensions or does not broadcast.
std::optional<at::Tensor> attention_mask_4d(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k);

/// softmax(q k^T * scale + mask) v with the same arguments as scaled_dot_product_attention
/// (q [B, H, S_q, D], k and v [B, H, S_kv, D], mask broadcastable to [B, H, S_q, S_kv], boolean
/// with true = attend, or additive). Scores, maxima and sums are fp32 for every input dtype. A
/// query whose keys are all masked gets a zero output and lse -inf (the math path's softmax gives
/// NaN there).
AttentionWithLse memory_efficient_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const std::optional<at::Tensor>& mask, double scale,
                                            const MemoryEfficientOptions& options = {});

}  // namespace shardit::nn
