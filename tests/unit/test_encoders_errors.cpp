// Failure paths of the text encoders: configs the reference would refuse or that we do not
// support, inputs of the wrong shape or length, plans whose degree cannot work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <limits>
#include <vector>

#include "shardit/models/clip/modeling_clip.h"
#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/models/t5/modeling_t5.h"
#include "shardit/nn/attention.h"
#include "support/test_support.h"

namespace shardit {
namespace test_encoders_errors {
namespace {

using ::testing::HasSubstr;
using testing::error_of;

nlohmann::json tiny_qwen3() {
  return {{"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48}, {"num_hidden_layers", 2},
          {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8}};
}

TEST(EncoderConfig, RefusesSlidingWindowAndUnknownRope) {
  nlohmann::json config = tiny_qwen3();
  config["use_sliding_window"] = true;
  EXPECT_THAT(error_of([&] { models::Qwen3Config::from_json(config, "qwen/config.json"); }),
              HasSubstr("qwen/config.json: 'use_sliding_window' is true"));
  config = tiny_qwen3();
  config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_THAT(error_of([&] { models::Qwen3Config::from_json(config, "qwen/config.json"); }),
              HasSubstr("rope_scaling type 'yarn' is not supported; supported: default"));
  config["rope_scaling"] = {{"type", "mrope"}, {"mrope_section", {1, 1, 2}}};
  EXPECT_NO_THROW(models::qwen2_5_vl_text_config_from_json(config, "vl/config.json"));
  config = tiny_qwen3();
  config["num_key_value_heads"] = 3;
  EXPECT_THAT(error_of([&] { models::Qwen3Config::from_json(config, "qwen/config.json"); }),
              HasSubstr("'num_attention_heads' 4 is not a multiple of 'num_key_value_heads' 3"));
}

TEST(EncoderConfig, T5FeedForwardProjection) {
  const nlohmann::json base = {{"vocab_size", 32}, {"d_model", 16}, {"d_kv", 4}, {"d_ff", 24}, {"num_layers", 1}, {"num_heads", 4}};
  nlohmann::json config = base;
  config["feed_forward_proj"] = "gated-gelu";
  const auto gated = models::T5Config::from_json(config, "t5/config.json");
  EXPECT_TRUE(gated.is_gated_act);
  EXPECT_EQ(gated.dense_act_fn, nn::Activation::GeluTanh);
  config["feed_forward_proj"] = "relu";
  EXPECT_FALSE(models::T5Config::from_json(config, "t5/config.json").is_gated_act);
  config["feed_forward_proj"] = "gated-gelu-new";
  EXPECT_THAT(error_of([&] { models::T5Config::from_json(config, "t5/config.json"); }),
              HasSubstr("'feed_forward_proj' is 'gated-gelu-new'"));
  config["feed_forward_proj"] = "mish";
  EXPECT_THAT(error_of([&] { models::T5Config::from_json(config, "t5/config.json"); }),
              HasSubstr("t5/config.json: 'dense_act_fn' is 'mish', which is not supported"));
}

TEST(EncoderInputs, ClipRefusesMoreTokensThanPositions) {
  nlohmann::json config = {{"vocab_size", 50}, {"hidden_size", 16}, {"intermediate_size", 32}, {"num_hidden_layers", 1},
                           {"num_attention_heads", 2}, {"max_position_embeddings", 8}};
  models::CLIPTextModel model(models::CLIPTextConfig::from_json(config, "clip/config.json"));
  nn::init_random(model, 1);
  EXPECT_THAT(error_of([&] { model.forward(at::zeros({1, 9}, at::kLong)); }),
              HasSubstr("CLIPTextModel: input_ids has 9 tokens; the model takes 1 to max_position_embeddings = 8"));
  EXPECT_THAT(error_of([&] { model.forward(at::zeros({1, 4}, at::kLong), at::ones({2, 4}, at::kLong)); }),
              HasSubstr("attention_mask"));
  EXPECT_THAT(error_of([&] { model.forward(at::full({1, 4}, 50, at::kLong)); }), HasSubstr("token ids must be in [0, 50)"));
}

// T5 has no position table: its length is bounded before the [heads, S, S] position bias exists.
TEST(EncoderInputs, T5RefusesMoreTokensThanTheBound) {
  const nlohmann::json config = {{"vocab_size", 32}, {"d_model", 16}, {"d_kv", 4}, {"d_ff", 24}, {"num_layers", 1},
                                 {"num_heads", 4}};
  models::T5EncoderModel model(models::T5Config::from_json(config, "t5/config.json"));
  nn::init_random(model, 1);
  EXPECT_THAT(error_of([&] { model.forward(at::zeros({1, models::kMaxT5Tokens + 1}, at::kLong)); }),
              HasSubstr("T5EncoderModel: input_ids has 4097 tokens; at most 4096 are encoded"));
  EXPECT_EQ(model.forward(at::zeros({1, 5}, at::kLong)).size(1), 5);
}

TEST(EncoderInputs, QwenRefusesHiddenStatesBeyondTheLastLayer) {
  models::Qwen3ForCausalLM model(models::Qwen3Config::from_json(tiny_qwen3(), "qwen/config.json"));
  nn::init_random(model, 1);
  EXPECT_THAT(error_of([&] { model.forward(at::zeros({1, 3}, at::kLong), std::nullopt, {3}); }),
              HasSubstr("hidden state 3 does not exist; the model has hidden states 0 (embeddings) to 2"));
}

TEST(EncoderAttention, GroupedQueryAttentionNeedsADivisor) {
  const at::Tensor q = at::randn({1, 3, 6, 4});
  const at::Tensor kv = at::randn({1, 3, 4, 4});
  EXPECT_THAT(error_of([&] { nn::attention({q, kv, kv}, nullptr); }),
              HasSubstr("6 query heads cannot share 4 key/value heads"));
}

TEST(EncoderAttention, GroupedQueryAttentionRepeatsEachKeyValueHead) {
  // Query head h uses key/value head h / 2: the same as attention with the heads repeated.
  const at::Tensor q = at::randn({2, 5, 4, 8});
  const at::Tensor k = at::randn({2, 5, 2, 8});
  const at::Tensor v = at::randn({2, 5, 2, 8});
  const at::Tensor grouped = nn::attention({q, k, v}, nullptr);
  const at::Tensor repeated = nn::attention({q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)}, nullptr);
  EXPECT_TRUE(at::allclose(grouped, repeated));
  const at::Tensor first_pair = nn::attention({q.narrow(2, 0, 2), k.narrow(2, 0, 1), v.narrow(2, 0, 1)}, nullptr);
  EXPECT_TRUE(at::allclose(grouped.narrow(2, 0, 16), first_pair));
}

TEST(EncoderAttention, AdditiveMaskIsCausalAndHidesPaddedKeys) {
  const at::Tensor mask = nn::additive_attention_mask(3, at::tensor({1, 1, 0}).unsqueeze(0), true, at::kFloat, at::kCPU);
  ASSERT_EQ(mask.sizes(), (std::vector<int64_t>{1, 1, 3, 3}));
  const float lowest = std::numeric_limits<float>::lowest();
  const std::vector<float> expected = {0, lowest, lowest, 0, 0, lowest, 0, 0, lowest};
  EXPECT_TRUE(at::equal(mask.flatten(), at::tensor(expected)));
}

}  // namespace
}  // namespace test_encoders_errors
}  // namespace shardit
