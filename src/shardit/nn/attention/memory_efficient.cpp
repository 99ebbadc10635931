#include "shardit/nn/attention/memory_efficient.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "shardit/nn/gemm.h"

namespace shardit::nn {

namespace {

// Keys per streamed block when not given: large enough that the product with v stays a good
// GEMM, small enough that a block of scores for a useful query block fits the budget.
constexpr int64_t kDefaultKeyBlock = 512;
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
  const int64_t key_block = std::max<int64_t>(1, std::min(s_kv, options.key_block > 0 ? options.key_block : kDefaultKeyBlock));
  int64_t query_block = options.query_block;
  if (query_block <= 0) {
    const int64_t per_query = std::max<int64_t>(1, heads * key_block * static_cast<int64_t>(sizeof(float)));
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

  // One batch entry at a time, key blocks outside and query blocks inside, so that every query
  // block folds the same key/value block into its running state. q[b], k[b], v[b] are [H, S, D]
  // views (the transformers pass transposed views of [B, S, H, D]) whose rows have unit stride:
  // BLAS reads them in place. oneDNN (nn/gemm.h) reads a product's second operand in place only
  // when it is contiguous per head, so there each key/value block is laid out once ([H, nk, D]
  // keys, [H, D, nk] values) for all query blocks.
  const bool onednn = gemm_backend_for(q.device(), q.scalar_type(), query_block, key_block * head_dim) ==
                      GemmBackend::OneDnn;
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor q_b = q.select(0, b), k_b = k.select(0, b), v_b = v.select(0, b);
    // [H or 1, S_q or 1, S_kv or 1]
    std::optional<at::Tensor> mask_b;
    if (mask4) mask_b = mask4->select(0, mask4->size(0) == 1 ? 0 : b);
    // Running maximum and sum per query, [H, S_q, 1] fp32, and the unnormalised output [H, S_q, D]
    // fp32: for fp32 inputs the output's own storage.
    const at::Tensor out_b = output.select(0, b);
    const at::Tensor acc = fp32 ? out_b : at::empty({heads, s_q, head_dim}, float_options);
    const at::Tensor running_max = at::empty({heads, s_q, 1}, float_options);
    const at::Tensor running_sum = at::empty({heads, s_q, 1}, float_options);
    for (int64_t k0 = 0; k0 < s_kv; k0 += key_block) {
      const int64_t nk = std::min(key_block, s_kv - k0);
      const bool first = k0 == 0;
      // [H, nk, D] and [H, D, nk]
      at::Tensor keys = k_b.narrow(1, k0, nk), values_t = v_b.narrow(1, k0, nk).transpose(1, 2);
      if (onednn) {
        keys = keys.contiguous();
        values_t = values_t.contiguous();
      }
      std::optional<at::Tensor> mask_keys;
      if (mask_b) mask_keys = mask_block(*mask_b, 2, k0, nk);
      for (int64_t q0 = 0; q0 < s_q; q0 += query_block) {
        const int64_t nq = std::min(query_block, s_q - q0);
        // Scaling q costs nq * D products instead of nq * nk. [H, nq, D]
        const at::Tensor qb = q_b.narrow(1, q0, nq) * scale;
        // [H, nq, nk]
        at::Tensor scores = bmm_nt(qb, keys);
        if (!fp32) scores = scores.to(at::kFloat);
        if (mask_keys) {
          const at::Tensor m = mask_block(*mask_keys, 1, q0, nq);
          if (bool_mask) {
            scores.masked_fill_(m.logical_not(), kNegInf);
          } else {
            scores.add_(m.to(at::kFloat));
          }
        }
        // [H, nq, 1] views of the running state, and [H, nq, D] of the output
        at::Tensor max_rows = running_max.narrow(1, q0, nq), sum_rows = running_sum.narrow(1, q0, nq);
        at::Tensor acc_rows = acc.narrow(1, q0, nq);
        const at::Tensor block_max = scores.amax(-1, /*keepdim=*/true);
        const at::Tensor new_max = first ? block_max : at::maximum(max_rows, block_max);
        // Without a mask every score is finite. With one, a row whose keys so far are all masked
        // keeps max -inf; shift it by 0 so exp gives 0, not NaN.
        const at::Tensor shift = mask_keys ? new_max.masked_fill(at::isinf(new_max), 0.0) : new_max;
        scores.sub_(shift).exp_();
        // [H, nq, D]
        at::Tensor weighted = bmm_nt(fp32 ? scores : scores.to(v.scalar_type()), values_t);
        if (!fp32) weighted = weighted.to(at::kFloat);
        if (first) {
          sum_rows.copy_(scores.sum(-1, /*keepdim=*/true));
          acc_rows.copy_(weighted);
        } else {
          const at::Tensor correction = (max_rows - shift).exp_();
          sum_rows.mul_(correction).add_(scores.sum(-1, /*keepdim=*/true));
          acc_rows.mul_(correction).add_(weighted);
        }
        max_rows.copy_(new_max);
      }
    }
    // Fully masked rows have sum 0 (and an output of 0): output 0, lse -inf.
    const at::Tensor empty_rows = running_sum.eq(0);
    const at::Tensor safe_sum = running_sum.masked_fill(empty_rows, 1.0);
    if (fp32) {
      out_b.div_(safe_sum);
    } else {
      out_b.copy_(acc.div_(safe_sum));
    }
    lse.select(0, b).copy_((running_max + safe_sum.log()).masked_fill_(empty_rows, kNegInf).squeeze(-1));
  }
  return {output, lse};
}

}  // namespace shardit::nn
