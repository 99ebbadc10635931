#include "shardit/nn/attention/memory_efficient.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>

#include "shardit/nn/cpu/fused.h"
#include "shardit/nn/gemm.h"

namespace shardit::nn {

namespace {

// Keys per block when not given: every key up to this many (one block, the softmax of each query
// row computed whole), streamed in blocks of this size beyond. A block of scores for a useful
// query block ([128, 8192] fp32 = 4 MiB) still fits the budget.
constexpr int64_t kMaxKeyBlock = 8192;
// The fused path's block of scores at most, in their own dtype. Each product call has a fixed
// cost in oneDNN, so a task takes a whole head while its scores fit (FLUX's 1536 tokens: 4.5 MiB
// in bf16); measured, blocks that fit the L2 cache (512 KiB) made the attention 1.6x slower.
constexpr int64_t kFusedScoresBytes = int64_t{8} << 20;
// Queries per block are rounded down to this multiple (GEMM-friendly), but never below it.
constexpr int64_t kQueryGranule = 16;

/// `mask` as a 4-D tensor broadcastable to [B, H, S_q, S_kv]; an error naming both shapes otherwise.
at::Tensor as_4d_mask(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  const std::optional<at::Tensor> m = attention_mask_4d(mask, q, k);
  TORCH_CHECK(m.has_value(), "attention: mask of shape ", mask.sizes(), " does not broadcast to [B, H, S_q, S_kv] = [",
              q.size(0), ", ", q.size(1), ", ", q.size(2), ", ", k.size(2),
              "] (at most 4 dimensions, each 1 or the size there)");
  return *m;
}

/// The rows [start, start + length) of dimension `dim` of a mask that may broadcast over it.
at::Tensor mask_block(const at::Tensor& mask, int64_t dim, int64_t start, int64_t length) {
  return mask.size(dim) == 1 ? mask : mask.narrow(dim, start, length);
}

/// One query block of one head through the fused softmax: rows [nq, D] of queries (unscaled: the
/// scale multiplies the fp32 scores), keys [S_kv, D], values_t [D, S_kv], the mask's rows
/// [nq or 1, S_kv] (bool); writes out [nq, D] and lse [nq]. The product with the values takes
/// the unnormalised weights and its rows are divided by their sums after; with several key
/// blocks, blocks merge by the online softmax (each block's weights relative to its own maximum).
void attend_fused(const at::Tensor& query_rows, const at::Tensor& keys, const at::Tensor& values_t,
                  const std::optional<at::Tensor>& mask_rows, double scale, int64_t key_block, at::Tensor out,
                  at::Tensor lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t s_kv = keys.size(0);
  const bool single_block = key_block >= s_kv;
  at::Tensor running_max, running_sum, acc;  // [nq], [nq], [nq, D] fp32
  for (int64_t k0 = 0; k0 < s_kv; k0 += key_block) {
    const int64_t nk = std::min(key_block, s_kv - k0);
    // [nq, nk] in the queries' dtype; the weights overwrite them
    at::Tensor scores = nn::linear(query_rows, keys.narrow(0, k0, nk));
    // [nq or 1, nk]
    at::Tensor mask;
    if (mask_rows) mask = mask_block(*mask_rows, 1, k0, nk).contiguous();
    at::Tensor probs = scores, block_max, block_sum;
    // Unnormalised weights: dividing the product [nq, D] costs less than the weights [nq, nk].
    TORCH_INTERNAL_ASSERT(cpu::try_softmax_rows(scores, mask, scale, /*normalize=*/false, probs, block_max, block_sum),
                          "memory_efficient_attention: the fused softmax refused scores ", scores.sizes(), " ",
                          scores.scalar_type());
    // [nq, D]
    const at::Tensor weighted = nn::linear(probs, values_t.narrow(1, k0, nk));
    if (single_block) {
      // A fully masked row: max -inf and sum 0, so lse = -inf and its weights and output are 0.
      const at::Tensor safe_sum = block_sum.masked_fill(block_sum.eq(0), 1.0);
      // The division in fp32 (the sums' dtype), rounded once into out: one pass.
      at::div_out(out, weighted, safe_sum.unsqueeze(1));
      lse.copy_(block_max + block_sum.log());
      return;
    }
    const at::Tensor weighted32 = weighted.to(at::kFloat);
    if (!acc.defined()) {
      running_max = block_max;
      running_sum = block_sum;
      acc = weighted32;
      continue;
    }
    const at::Tensor new_max = at::maximum(running_max, block_max);
    // Rows whose keys so far are all masked keep max -inf: shift by 0, so exp gives 0, not NaN.
    const at::Tensor shift = new_max.masked_fill(at::isinf(new_max), 0.0);
    const at::Tensor old_correction = (running_max - shift).exp_();
    const at::Tensor new_correction = (block_max - shift).exp_();
    running_sum = running_sum * old_correction + block_sum * new_correction;
    acc = acc * old_correction.unsqueeze(1) + weighted32 * new_correction.unsqueeze(1);
    running_max = new_max;
  }
  const at::Tensor empty_rows = running_sum.eq(0);
  const at::Tensor safe_sum = running_sum.masked_fill(empty_rows, 1.0);
  out.copy_(acc.div_(safe_sum.unsqueeze(1)));
  lse.copy_((running_max + safe_sum.log()).masked_fill_(empty_rows, kNegInf));
}

/// The fused path over every (batch, head, query block): each is one task, run by one thread from
/// its products to its output rows (a block's scores are at most kFusedScoresBytes), its products
/// single-threaded in the OpenMP region: the same kernel whatever the thread count or the number
/// of tasks, so the bits depend on neither.
void fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask4, double scale, int64_t query_block, int64_t key_block,
                     bool onednn, at::Tensor& output, at::Tensor& lse) {
  const int64_t batch = q.size(0), heads = q.size(1), s_q = q.size(2);
  const int64_t query_blocks = (s_q + query_block - 1) / query_block;
  const int64_t tasks = batch * heads * query_blocks;
  // [B, H, S, D] laid out head-major: the callers' q, k, v are views of [B, S, H, D], whose rows
  // of one head are strided by the other heads; bf16 products read such rows 2-3x slower than
  // adjacent ones (measured: [1536, 128] x [128, 1536] in 2.2 ms against 0.6 ms on one core).
  const at::Tensor queries = q.contiguous(), keys_all = k.contiguous(), values_all = v.contiguous();
  std::mutex failure_mutex;
  std::exception_ptr failure;
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t task = 0; task < tasks; ++task) {
    try {
      const int64_t b = task / (heads * query_blocks);
      const int64_t h = task / query_blocks % heads;
      const int64_t q0 = task % query_blocks * query_block;
      const int64_t nq = std::min(query_block, s_q - q0);
      // [S_kv, D] keys and [D, S_kv] values: each product's second operand as nn::linear takes it
      at::Tensor keys = keys_all[b][h], values_t = values_all[b][h].t();
      if (onednn) values_t = values_t.contiguous();
      // [nq or 1, S_kv]
      std::optional<at::Tensor> mask_rows;
      if (mask4) {
        const at::Tensor mask_b = mask4->select(0, mask4->size(0) == 1 ? 0 : b);
        mask_rows = mask_block(mask_b.select(0, mask_b.size(0) == 1 ? 0 : h), 0, q0, nq);
      }
      attend_fused(queries[b][h].narrow(0, q0, nq), keys, values_t, mask_rows, scale, key_block,
                   output[b][h].narrow(0, q0, nq), lse[b][h].narrow(0, q0, nq));
    } catch (...) {
      const std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

std::optional<at::Tensor> attention_mask_4d(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  if (mask.dim() > 4) return std::nullopt;
  at::Tensor m = mask;
  while (m.dim() < 4) m = m.unsqueeze(0);
  const int64_t target[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
  for (int64_t d = 0; d < 4; ++d) {
    if (m.size(d) != 1 && m.size(d) != target[d]) return std::nullopt;
  }
  return m;
}

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
  // The fused CPU softmax (nn/cpu/fused.h) takes fp32 or bf16 scores, a finite positive scale and
  // no mask or a boolean one over the keys; anything else runs the LibTorch operators below.
  const bool fused = cpu::fused_kernels_enabled() && q.device().is_cpu() && scale > 0.0 && std::isfinite(scale) &&
                     (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                     k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                     (!mask4 || (bool_mask && mask4->size(3) == s_kv));
  const bool onednn = gemm_backend_for(q.device(), q.scalar_type(), query_block, key_block * head_dim) ==
                      GemmBackend::OneDnn;
  if (fused) {
    int64_t fused_query_block = options.query_block;
    if (fused_query_block <= 0) {
      const int64_t per_query = std::max<int64_t>(1, key_block * static_cast<int64_t>(q.element_size()));
      fused_query_block = std::max(kQueryGranule, kFusedScoresBytes / per_query / kQueryGranule * kQueryGranule);
    }
    fused_attention(q, k, v, mask4, scale, std::min(fused_query_block, std::max<int64_t>(1, s_q)), key_block, onednn,
                    output, lse);
    return {output, lse};
  }
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
        std::optional<at::Tensor> mask_rows;
        if (mask_h) mask_rows = mask_block(*mask_h, 0, q0, nq);
        // Scaling q costs nq * D products instead of nq * S_kv. [nq, D]
        const at::Tensor qb = q_h.narrow(0, q0, nq) * scale;
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
