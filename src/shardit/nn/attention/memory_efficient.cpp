#include "shardit/nn/attention/memory_efficient.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "shardit/nn/gemm.h"

namespace shardit::nn {

namespace {

// Keys per block when not given: every key up to this many (one block, the softmax of each query
// row computed whole), streamed in blocks of this size beyond. A block of scores for a useful
// query block ([128, 8192] fp32 = 4 MiB) still fits the budget.
constexpr int64_t kMaxKeyBlock = 8192;
// Queries per block are rounded down to this multiple (GEMM-friendly), but never below it.
constexpr int64_t kQueryGranule = 16;

/// `mask` as a 4-D tensor broadcastable to [B, H, S_q, S_kv].
at::Tensor as_4d_mask(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(mask.dim() <= 4, "attention: mask has ", mask.dim(), " dimensions (shape ", mask.sizes(),
              "); expected at most 4, broadcastable to [B, H, S_q, S_kv] = [", q.size(0), ", ", q.size(1), ", ",
              q.size(2), ", ", k.size(2), "]");
  at::Tensor m = mask;
  while (m.dim() < 4) m = m.unsqueeze(0);
  const int64_t target[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
  for (int64_t d = 0; d < 4; ++d) {
    TORCH_CHECK(m.size(d) == 1 || m.size(d) == target[d], "attention: mask of shape ", mask.sizes(),
                " does not broadcast to [B, H, S_q, S_kv] = [", target[0], ", ", target[1], ", ", target[2], ", ",
                target[3], "]");
  }
  return m;
}

/// The rows [start, start + length) of dimension `dim` of a mask that may broadcast over it.
at::Tensor mask_block(const at::Tensor& mask, int64_t dim, int64_t start, int64_t length) {
  return mask.size(dim) == 1 ? mask : mask.narrow(dim, start, length);
}

}  // namespace

AttentionWithLse memory_efficient_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const std::optional<at::Tensor>& mask, double scale,
                                            const MemoryEfficientOptions& options) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "memory_efficient_attention: q, k, v must be [B, H, S, D], got shapes ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  const int64_t batch = q.size(0), heads = q.size(1), s_q = q.size(2), s_kv = k.size(2), head_dim = v.size(3);
  TORCH_CHECK(k.size(1) == heads && v.size(1) == heads && k.size(0) == batch && v.size(0) == batch,
              "memory_efficient_attention: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " must have the same batch and heads");
  const int64_t key_block = std::max<int64_t>(1, std::min(s_kv, options.key_block > 0 ? options.key_block : kMaxKeyBlock));
  int64_t query_block = options.query_block;
  if (query_block <= 0) {
    const int64_t per_query = std::max<int64_t>(1, key_block * static_cast<int64_t>(sizeof(float)));
    query_block = std::max(kQueryGranule, options.scores_budget_bytes / per_query / kQueryGranule * kQueryGranule);
  }
  query_block = std::min(query_block, std::max<int64_t>(1, s_q));

  std::optional<at::Tensor> mask4;
  if (mask.has_value() && mask->defined()) mask4 = as_4d_mask(*mask, q, k);
  const bool bool_mask = mask4.has_value() && mask4->scalar_type() == at::kBool;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const bool fp32 = q.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat;

  const auto float_options = q.options().dtype(at::kFloat);
  // [B, S_q, H, D] storage seen as [B, H, S_q, D]: the callers' transpose back to [B, S_q, H * D]
  // is then a view, not a copy.
  at::Tensor output = at::empty({batch, s_q, heads, head_dim}, q.options()).transpose(1, 2);
  at::Tensor lse = at::empty({batch, heads, s_q}, float_options);
  if (s_kv == 0) {
    // No keys: every query is fully masked.
    output.zero_();
    lse.fill_(kNegInf);
    return {output, lse};
  }

  // One head at a time: a block of scores ([nq, nk] of one head) stays in the core's cache
  // through the softmax and the product with v, where scores batched over all heads go through
  // main memory several times. The products run on the selected GEMM kernel (nn::linear: x w^T).
  // q[b, h], k[b, h], v[b, h] are [S, D] views (of [B, S, H, D] in the transformers) whose rows
  // are strided: BLAS reads them in place, oneDNN needs the keys and values contiguous, so there
  // they are laid out once per head.
  const bool onednn = gemm_backend_for(q.device(), q.scalar_type(), query_block, key_block * head_dim) ==
                      GemmBackend::OneDnn;
  for (int64_t b = 0; b < batch; ++b) {
    // [H or 1, S_q or 1, S_kv or 1]
    std::optional<at::Tensor> mask_b;
    if (mask4) mask_b = mask4->select(0, mask4->size(0) == 1 ? 0 : b);
    for (int64_t h = 0; h < heads; ++h) {
      const at::Tensor q_h = q[b][h];  // [S_q, D]
      // [S_kv, D] keys and [D, S_kv] values: each product's second operand as nn::linear takes it
      at::Tensor keys = k[b][h], values_t = v[b][h].t();
      if (onednn) {
        keys = keys.contiguous();
        values_t = values_t.contiguous();
      }
      // [S_q or 1, S_kv or 1]
      std::optional<at::Tensor> mask_h;
      if (mask_b) mask_h = mask_b->select(0, mask_b->size(0) == 1 ? 0 : h);
      const at::Tensor out_h = output[b][h];  // [S_q, D]
      const at::Tensor lse_h = lse[b][h];     // [S_q]
      for (int64_t q0 = 0; q0 < s_q; q0 += query_block) {
        const int64_t nq = std::min(query_block, s_q - q0);
        // Scaling q costs nq * D products instead of nq * S_kv. [nq, D]
        const at::Tensor qb = q_h.narrow(0, q0, nq) * scale;
        std::optional<at::Tensor> mask_rows;
        if (mask_h) mask_rows = mask_block(*mask_h, 0, q0, nq);
        // Running maximum, running sum and unnormalised output of this query block:
        // [nq, 1], [nq, 1], [nq, D] fp32. Set by the first key block.
        at::Tensor running_max, running_sum, acc;
        for (int64_t k0 = 0; k0 < s_kv; k0 += key_block) {
          const int64_t nk = std::min(key_block, s_kv - k0);
          // [nq, nk]
          at::Tensor scores = nn::linear(qb, keys.narrow(0, k0, nk));
          if (!fp32) scores = scores.to(at::kFloat);
          if (mask_rows) {
            const at::Tensor m = mask_block(*mask_rows, 1, k0, nk);
            if (bool_mask) {
              scores.masked_fill_(m.logical_not(), kNegInf);
            } else {
              scores.add_(m.to(at::kFloat));
            }
          }
          // [nq, 1]
          const at::Tensor block_max = scores.amax(-1, /*keepdim=*/true);
          const at::Tensor new_max = running_max.defined() ? at::maximum(running_max, block_max) : block_max;
          // Without a mask every score is finite. With one, a row whose keys so far are all
          // masked keeps max -inf; shift it by 0 so exp gives 0, not NaN.
          const at::Tensor shift = mask_rows ? new_max.masked_fill(at::isinf(new_max), 0.0) : new_max;
          scores.sub_(shift).exp_();
          // [nq, D]
          at::Tensor weighted = nn::linear(fp32 ? scores : scores.to(v.scalar_type()), values_t.narrow(1, k0, nk));
          if (!fp32) weighted = weighted.to(at::kFloat);
          if (!acc.defined()) {
            running_sum = scores.sum(-1, /*keepdim=*/true);
            acc = weighted;
          } else {
            const at::Tensor correction = (running_max - shift).exp_();
            running_sum.mul_(correction).add_(scores.sum(-1, /*keepdim=*/true));
            acc.mul_(correction).add_(weighted);
          }
          running_max = new_max;
        }
        // Fully masked rows have sum 0 (and an output of 0): output 0, lse -inf.
        const at::Tensor empty_rows = running_sum.eq(0);
        const at::Tensor safe_sum = running_sum.masked_fill(empty_rows, 1.0);
        out_h.narrow(0, q0, nq).copy_(acc.div_(safe_sum));
        lse_h.narrow(0, q0, nq).copy_((running_max + safe_sum.log()).masked_fill_(empty_rows, kNegInf).squeeze(-1));
      }
    }
  }
  return {output, lse};
}

}  // namespace shardit::nn
