// nn::scaled_dot_product_attention against softmax(q k^T * scale + mask) v computed in float64,
// including sequences long enough that the heads are processed in groups.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "shardit/nn/attention.h"
#include "support/test_support.h"

namespace test_attention {
namespace {

using shardit::testing::tensors_close;

at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& additive_mask) {
  const at::Tensor q64 = q.to(at::kDouble), k64 = k.to(at::kDouble), v64 = v.to(at::kDouble);
  at::Tensor scores = at::matmul(q64, k64.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (additive_mask.defined()) scores = scores + additive_mask.to(at::kDouble);
  return at::matmul(at::softmax(scores, -1), v64);
}

TEST(Attention, MatchesReferenceShortSequence) {
  at::manual_seed(1);
  const at::Tensor q = at::randn({2, 3, 7, 16}), k = at::randn({2, 3, 9, 16}), v = at::randn({2, 3, 9, 16});
  EXPECT_TRUE(tensors_close("attention", shardit::nn::scaled_dot_product_attention(q, k, v),
                            reference_attention(q, k, v, {}), 1e-5, 1e-5));
}

TEST(Attention, LongSequenceProcessedInHeadGroupsMatchesReference) {
  // 4096 x 4096 scores are 64 MiB per head: 6 heads exceed the scores budget and run in groups.
  at::manual_seed(2);
  const at::Tensor q = at::randn({1, 6, 4096, 8}), k = at::randn({1, 6, 4096, 8}), v = at::randn({1, 6, 4096, 8});
  EXPECT_TRUE(tensors_close("grouped attention", shardit::nn::scaled_dot_product_attention(q, k, v),
                            reference_attention(q, k, v, {}), 1e-5, 1e-5));
}

TEST(Attention, BooleanKeyMaskHidesKeysInEveryGroup) {
  at::manual_seed(3);
  const at::Tensor q = at::randn({2, 6, 4096, 8}), k = at::randn({2, 6, 4096, 8}), v = at::randn({2, 6, 4096, 8});
  // Sample 1 sees only its first 100 keys: [B, 1, 1, S_kv], broadcast over heads and queries.
  at::Tensor keep = at::ones({2, 1, 1, 4096}, at::kBool);
  keep[1].narrow(-1, 100, 4096 - 100).fill_(false);
  const at::Tensor additive = at::zeros({2, 1, 1, 4096}).masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(tensors_close("masked attention", shardit::nn::scaled_dot_product_attention(q, k, v, keep),
                            reference_attention(q, k, v, additive), 1e-5, 1e-5));
}

TEST(Attention, PerHeadAdditiveMaskFollowsItsHeads) {
  at::manual_seed(4);
  const at::Tensor q = at::randn({1, 6, 4096, 8}), k = at::randn({1, 6, 4096, 8}), v = at::randn({1, 6, 4096, 8});
  const at::Tensor bias = at::randn({1, 6, 1, 4096});
  EXPECT_TRUE(tensors_close("per-head bias", shardit::nn::scaled_dot_product_attention(q, k, v, bias),
                            reference_attention(q, k, v, bias), 1e-5, 1e-5));
}

TEST(Attention, PerHeadMaskWithoutBatchDimensionFollowsItsHeads) {
  // [H, 1, S_kv] broadcasts over batch and queries; its heads are split with the head groups.
  at::manual_seed(5);
  const at::Tensor q = at::randn({2, 6, 4096, 8}), k = at::randn({2, 6, 4096, 8}), v = at::randn({2, 6, 4096, 8});
  const at::Tensor bias = at::randn({6, 1, 4096});
  EXPECT_TRUE(tensors_close("per-head bias without batch", shardit::nn::scaled_dot_product_attention(q, k, v, bias),
                            reference_attention(q, k, v, bias), 1e-5, 1e-5));
}

}  // namespace
}  // namespace test_attention
