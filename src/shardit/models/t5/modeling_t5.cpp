#include "shardit/models/t5/modeling_t5.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <vector>

#include "shardit/core/profile.h"
#include "shardit/io/model_folder.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/inputs.h"

namespace shardit::models {

T5Config T5Config::from_json(const nlohmann::json& json, const std::string& source) {
  const io::ConfigReader reader(json, source);
  T5Config config;
  config.vocab_size = reader.integer("vocab_size", config.vocab_size, 1, int64_t{1} << 31);
  config.d_model = reader.integer("d_model", config.d_model, 1, io::kMaxConfigDim);
  config.d_kv = reader.integer("d_kv", config.d_kv, 1, io::kMaxConfigDim);
  config.d_ff = reader.integer("d_ff", config.d_ff, 1, io::kMaxConfigDim);
  config.num_layers = reader.integer("num_layers", config.num_layers, 1, io::kMaxConfigLayers);
  config.num_heads = reader.integer("num_heads", config.num_heads, 1, io::kMaxConfigDim);
  config.relative_attention_num_buckets =
      reader.integer("relative_attention_num_buckets", config.relative_attention_num_buckets, 4, io::kMaxConfigDim);
  config.relative_attention_max_distance =
      reader.integer("relative_attention_max_distance", config.relative_attention_max_distance, 1, io::kMaxConfigDim);
  config.layer_norm_epsilon = reader.number("layer_norm_epsilon", config.layer_norm_epsilon, 1e-30, 1.0);
  reader.width("num_heads", config.num_heads, "d_kv", config.d_kv);
  // transformers' T5Config: "gated-<act>" or "<act>"; "gated-gelu" means gelu_new. Explicit
  // dense_act_fn / is_gated_act keys (save_pretrained writes them) take precedence, as there.
  const std::string projection = reader.string("feed_forward_proj", "relu");
  const size_t dash = projection.find('-');
  const bool gated = projection.rfind("gated-", 0) == 0;
  reader.require(dash == std::string::npos || (gated && projection.find('-', dash + 1) == std::string::npos),
                 "'feed_forward_proj' is '", projection, "'; expected '<act>' or 'gated-<act>' (e.g. 'gated-gelu')");
  std::string act = gated ? projection.substr(dash + 1) : projection;
  if (projection == "gated-gelu") act = "gelu_new";
  config.is_gated_act = reader.boolean("is_gated_act", gated);
  config.dense_act_fn = nn::parse_activation(reader.string("dense_act_fn", act), source, "dense_act_fn");
  return config;
}

at::Tensor t5_relative_position_bucket(int64_t query_len, int64_t key_len, int64_t num_buckets, int64_t max_distance,
                                       at::Device device) {
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(device);
  // [Q, K]: j - i
  at::Tensor relative = at::arange(key_len, long_options).unsqueeze(0) - at::arange(query_len, long_options).unsqueeze(1);
  // Bidirectional: half the buckets for positive offsets.
  const int64_t half = num_buckets / 2;
  const at::Tensor buckets = relative.gt(0).to(at::kLong) * half;
  relative = relative.abs();
  const int64_t max_exact = half / 2;
  const at::Tensor is_small = relative.lt(max_exact);
  // fp32 as the reference: log(rel / max_exact) / log(max_distance / max_exact) * (half - max_exact)
  const at::Tensor scaled = at::log(relative.to(at::kFloat) / static_cast<float>(max_exact)) /
                            static_cast<float>(std::log(static_cast<double>(max_distance) / max_exact)) *
                            static_cast<float>(half - max_exact);
  const at::Tensor large = (scaled.to(at::kLong) + max_exact).clamp_max(half - 1);
  return buckets + at::where(is_small, relative, large);
}

T5Attention::T5Attention(const T5Config& config, bool has_relative_attention_bias) : config_(config) {
  const int64_t d = config.d_model;
  const int64_t inner = config.inner_dim();
  q = register_module("q", std::make_shared<nn::Linear>(nn::LinearOptions(d, inner).with_bias(false)));
  k = register_module("k", std::make_shared<nn::Linear>(nn::LinearOptions(d, inner).with_bias(false)));
  v = register_module("v", std::make_shared<nn::Linear>(nn::LinearOptions(d, inner).with_bias(false)));
  o = register_module("o", std::make_shared<nn::Linear>(nn::LinearOptions(inner, d).with_bias(false)));
  if (has_relative_attention_bias) {
    relative_attention_bias = register_module(
        "relative_attention_bias", std::make_shared<nn::Embedding>(config.relative_attention_num_buckets, config.num_heads));
  }
}

at::Tensor T5Attention::compute_bias(int64_t seq_len) {
  TORCH_INTERNAL_ASSERT(relative_attention_bias != nullptr, "compute_bias on a block without the bias table");
  const at::Tensor bucket = t5_relative_position_bucket(seq_len, seq_len, config_.relative_attention_num_buckets,
                                                        config_.relative_attention_max_distance,
                                                        relative_attention_bias->weight.device());
  emit("relative_position_bucket", bucket);
  // [S, S, H_local] -> [1, H_local, S, S]
  return relative_attention_bias->forward(bucket).permute({2, 0, 1}).unsqueeze(0);
}

at::Tensor T5Attention::forward(const at::Tensor& hidden_states, const at::Tensor& bias) {
  // [B, S, H_local, d_kv] each
  const nn::HeadsQKV qkv = nn::project_heads(hidden_states, {*q, *k, *v}, config_.d_kv);
  // T5 folds the scale into its initialisation: scores are q k^T unscaled.
  return o->forward(nn::attention(qkv, nullptr, bias, /*scale=*/1.0));
}

T5LayerSelfAttention::T5LayerSelfAttention(const T5Config& config, bool has_relative_attention_bias) {
  SelfAttention = register_module("SelfAttention", std::make_shared<T5Attention>(config, has_relative_attention_bias));
  layer_norm = register_module(
      "layer_norm", std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(config.d_model).with_eps(config.layer_norm_epsilon)));
}

at::Tensor T5LayerSelfAttention::forward(const at::Tensor& hidden_states, const at::Tensor& bias) {
  return hidden_states + SelfAttention->forward(layer_norm->forward(hidden_states), bias);
}

T5DenseActDense::T5DenseActDense(const T5Config& config) : gated_(config.is_gated_act), activation_(config.dense_act_fn) {
  const auto linear = [](int64_t in, int64_t out) {
    return std::make_shared<nn::Linear>(nn::LinearOptions(in, out).with_bias(false));
  };
  if (gated_) {
    wi_0 = register_module("wi_0", linear(config.d_model, config.d_ff));
    wi_1 = register_module("wi_1", linear(config.d_model, config.d_ff));
  } else {
    wi = register_module("wi", linear(config.d_model, config.d_ff));
  }
  wo = register_module("wo", linear(config.d_ff, config.d_model));
}

at::Tensor T5DenseActDense::forward(const at::Tensor& x) {
  // [B, S, F_local]
  const at::Tensor hidden = gated_ ? nn::activate(wi_0->forward(x), activation_) * wi_1->forward(x)
                                   : nn::activate(wi->forward(x), activation_);
  // wo stays fp32 under a bf16 load: its input follows its dtype, as the reference casts it.
  return wo->forward(hidden.to(wo->weight_dtype()));
}

T5LayerFF::T5LayerFF(const T5Config& config) {
  DenseReluDense = register_module("DenseReluDense", std::make_shared<T5DenseActDense>(config));
  layer_norm = register_module(
      "layer_norm", std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(config.d_model).with_eps(config.layer_norm_epsilon)));
}

at::Tensor T5LayerFF::forward(const at::Tensor& hidden_states) {
  return hidden_states + DenseReluDense->forward(layer_norm->forward(hidden_states));
}

T5Block::T5Block(const T5Config& config, bool has_relative_attention_bias) {
  layer = register_module("layer", std::make_shared<Layers>());
  layer->self_attention = layer->add("0", std::make_shared<T5LayerSelfAttention>(config, has_relative_attention_bias));
  layer->feed_forward = layer->add("1", std::make_shared<T5LayerFF>(config));
}

at::Tensor T5Block::forward(const at::Tensor& hidden_states, const at::Tensor& bias) {
  SHARDIT_PROFILE_SCOPE("T5Block");
  return layer->feed_forward->forward(layer->self_attention->forward(hidden_states, bias));
}

T5Stack::T5Stack(const T5Config& config) {
  block = register_module("block", std::make_shared<nn::ModuleList<T5Block>>());
  for (int64_t i = 0; i < config.num_layers; ++i) block->push_back(std::make_shared<T5Block>(config, i == 0));
  final_layer_norm = register_module(
      "final_layer_norm",
      std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(config.d_model).with_eps(config.layer_norm_epsilon)));
}

T5EncoderModel::T5EncoderModel(const T5Config& config) : config(config) {
  shared = register_module("shared", std::make_shared<nn::Embedding>(config.vocab_size, config.d_model));
  encoder = register_module("encoder", std::make_shared<T5Stack>(config));
}

namespace {

/// The plan for T5's gated (wi_0, wi_1) or plain (wi) feed-forward.
parallel::TpPlan t5_plan(bool gated) {
  using parallel::ShardStyle;
  // Megatron's split: q/k/v and the FF input(s) colwise, o and wo rowwise (one all-reduce each);
  // the tied token table split by vocabulary (any degree); block 0's bias table split by heads
  // (its columns), so each rank looks up the bias of its own heads. Replicated: the RMS norms.
  parallel::TpPlan plan = {
      {"shared", ShardStyle::Rowwise},
      {"encoder.block.0.layer.0.SelfAttention.relative_attention_bias", ShardStyle::Colwise},
      {"encoder.block.*.layer.0.SelfAttention.q", ShardStyle::Colwise},
      {"encoder.block.*.layer.0.SelfAttention.k", ShardStyle::Colwise},
      {"encoder.block.*.layer.0.SelfAttention.v", ShardStyle::Colwise},
      {"encoder.block.*.layer.0.SelfAttention.o", ShardStyle::Rowwise},
      {"encoder.block.*.layer.1.DenseReluDense.wo", ShardStyle::Rowwise},
  };
  for (const char* input : gated ? std::vector<const char*>{"wi_0", "wi_1"} : std::vector<const char*>{"wi"}) {
    plan.push_back({std::string("encoder.block.*.layer.1.DenseReluDense.") + input, ShardStyle::Colwise});
  }
  return plan;
}

}  // namespace

const parallel::TpPlan& T5EncoderModel::tp_plan() const {
  static const parallel::TpPlan gated = t5_plan(true);
  static const parallel::TpPlan plain = t5_plan(false);
  return config.is_gated_act ? gated : plain;
}

parallel::ModelTraits T5EncoderModel::traits() const {
  parallel::ModelTraits traits;
  traits.divisors = {{"num_heads", config.num_heads}};
  traits.keep_in_fp32_modules = {"wo"};
  // encoder.embed_tokens is tied to shared: checkpoints store either name, or both.
  traits.key_aliases = {{"shared.weight", {"encoder.embed_tokens.weight"}}};
  return traits;
}

at::Tensor T5EncoderModel::forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask) {
  SHARDIT_PROFILE_SCOPE("T5EncoderModel");
  const std::string where = type_name();
  TORCH_CHECK(is_materialized(), where, ": forward called before the weights were loaded");
  const auto shape = nn::check_shape(where, "input_ids", input_ids, {"B", "S"});
  const int64_t seq_len = shape[1];
  TORCH_CHECK(seq_len >= 1, where, ": input_ids has no tokens");
  // T5 has no position table to bound its length, but its position bias is [heads, S, S].
  TORCH_CHECK(seq_len <= kMaxT5Tokens, where, ": input_ids has ", seq_len, " tokens; at most ", kMaxT5Tokens,
              " are encoded (the position bias alone holds heads x ", seq_len, "^2 values)");
  if (attention_mask.has_value()) nn::check_shape(where, "attention_mask", *attention_mask, {{"B", shape[0]}, {"S", seq_len}});
  const at::Device device = this->device();
  // [B, S, D], not scaled
  at::Tensor hidden = shared->forward(input_ids.to(device, at::kLong));
  emit("hidden_states.0", hidden);

  // [1, H_local, S, S] from block 0, then + the key mask [B, 1, 1, S] when given
  const at::Tensor position_bias = encoder->block->operator[](0).layer->self_attention->SelfAttention->compute_bias(seq_len);
  emit("position_bias", position_bias);
  at::Tensor bias = position_bias.to(hidden.scalar_type());
  if (attention_mask.has_value()) {
    bias = bias + nn::additive_attention_mask(seq_len, attention_mask, /*causal=*/false, hidden.scalar_type(), device);
  }
  const int64_t blocks = static_cast<int64_t>(encoder->block->size());
  for (int64_t i = 0; i < blocks; ++i) {
    hidden = (*encoder->block)[i].forward(hidden, bias);
    if (i + 1 < blocks) emit("hidden_states." + std::to_string(i + 1), hidden);
  }
  // transformers lists the final norm's output as the last hidden state, not the last block's.
  const at::Tensor last = encoder->final_layer_norm->forward(hidden);
  emit("hidden_states." + std::to_string(blocks), last);
  emit("last_hidden_state", last);
  return last;
}

at::Tensor flux_t5_prompt_embeds(T5EncoderModel& text_encoder, const at::Tensor& input_ids) {
  return text_encoder.forward(input_ids);
}

}  // namespace shardit::models
