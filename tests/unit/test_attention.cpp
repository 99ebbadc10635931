// nn::scaled_dot_product_attention against softmax(q k^T * scale + mask) v computed in float64, on
// the math backend and on the one auto picks, including sequences long enough that the math
// backend processes the heads in groups.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "shardit/nn/attention.h"
#include "shardit/nn/attention/backends.h"
#include "support/test_support.h"

namespace test_attention {
namespace {

/// Runs `check` on the math backend, whose head groups the long sequences here exercise (4096 x
/// 4096 fp32 scores are 64 MiB a head, so 6 heads exceed nn::kMathScoresBudgetBytes and run in
/// groups), and on the backend auto picks (what the models run).
template <class Check>
void on_math_and_auto(Check check) {
  for (const char* backend : {"math", "auto"}) {
    SCOPED_TRACE(backend);
    shardit::nn::AttentionBackendGuard guard(backend);
    check();
  }
}

using shardit::testing::tensors_close;

// One (batch, head) slice at a time: the scores of every head at once, in float64, would be 1.6 GB
// for the long cases below (and most of their time spent faulting that memory in).
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& additive_mask) {
  const at::Tensor q64 = q.to(at::kDouble), k64 = k.to(at::kDouble), v64 = v.to(at::kDouble);
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), keys = k.size(2);
  // The mask as a view over [B, H, S_q, S_kv] (broadcast, nothing copied).
  const at::Tensor mask =
      additive_mask.defined() ? additive_mask.to(at::kDouble).expand({batch, heads, queries, keys}) : at::Tensor();
  at::Tensor out = at::empty({batch, heads, queries, v.size(3)}, at::kDouble);
  // Two [S_q, S_kv] buffers reused by every slice.
  at::Tensor scores = at::empty({queries, keys}, at::kDouble), probabilities = at::empty_like(scores);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      at::matmul_out(scores, q64[b][h], k64[b][h].t());
      scores.div_(std::sqrt(static_cast<double>(q.size(-1))));
      if (mask.defined()) scores.add_(mask[b][h]);
      at::softmax_out(probabilities, scores, -1);
      at::Tensor slice = out[b][h];
      at::matmul_out(slice, probabilities, v64[b][h]);
    }
  }
  return out;
}

TEST(Attention, MatchesReferenceShortSequence) {
  at::manual_seed(1);
  const at::Tensor q = at::randn({2, 3, 7, 16}), k = at::randn({2, 3, 9, 16}), v = at::randn({2, 3, 9, 16});
  EXPECT_TRUE(tensors_close("attention", shardit::nn::scaled_dot_product_attention(q, k, v),
                            reference_attention(q, k, v, {}), 1e-5, 1e-5));
}

TEST(Attention, LongSequenceProcessedInHeadGroupsMatchesReference) {
  at::manual_seed(2);
  const at::Tensor q = at::randn({1, 6, 4096, 8}), k = at::randn({1, 6, 4096, 8}), v = at::randn({1, 6, 4096, 8});
  on_math_and_auto([&] {
    EXPECT_TRUE(tensors_close("grouped attention", shardit::nn::scaled_dot_product_attention(q, k, v),
                              reference_attention(q, k, v, {}), 1e-5, 1e-5));
  });
}

TEST(Attention, BooleanKeyMaskHidesKeysInEveryGroup) {
  at::manual_seed(3);
  const at::Tensor q = at::randn({2, 6, 4096, 8}), k = at::randn({2, 6, 4096, 8}), v = at::randn({2, 6, 4096, 8});
  // Sample 1 sees only its first 100 keys: [B, 1, 1, S_kv], broadcast over heads and queries.
  at::Tensor keep = at::ones({2, 1, 1, 4096}, at::kBool);
  keep[1].narrow(-1, 100, 4096 - 100).fill_(false);
  const at::Tensor additive = at::zeros({2, 1, 1, 4096}).masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
  on_math_and_auto([&] {
    EXPECT_TRUE(tensors_close("masked attention", shardit::nn::scaled_dot_product_attention(q, k, v, keep),
                              reference_attention(q, k, v, additive), 1e-5, 1e-5));
  });
}

TEST(Attention, PerHeadAdditiveMaskFollowsItsHeads) {
  at::manual_seed(4);
  const at::Tensor q = at::randn({1, 6, 4096, 8}), k = at::randn({1, 6, 4096, 8}), v = at::randn({1, 6, 4096, 8});
  const at::Tensor bias = at::randn({1, 6, 1, 4096});
  on_math_and_auto([&] {
    EXPECT_TRUE(tensors_close("per-head bias", shardit::nn::scaled_dot_product_attention(q, k, v, bias),
                              reference_attention(q, k, v, bias), 1e-5, 1e-5));
  });
}

TEST(Attention, PerHeadMaskWithoutBatchDimensionFollowsItsHeads) {
  // [H, 1, S_kv] broadcasts over batch and queries; its heads are split with the head groups.
  at::manual_seed(5);
  const at::Tensor q = at::randn({2, 6, 4096, 8}), k = at::randn({2, 6, 4096, 8}), v = at::randn({2, 6, 4096, 8});
  const at::Tensor bias = at::randn({6, 1, 4096});
  on_math_and_auto([&] {
    EXPECT_TRUE(tensors_close("per-head bias without batch", shardit::nn::scaled_dot_product_attention(q, k, v, bias),
                              reference_attention(q, k, v, bias), 1e-5, 1e-5));
  });
}

}  // namespace
}  // namespace test_attention
