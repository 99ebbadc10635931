#include "shardit/models/qwen/modeling_qwen3.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <utility>

#include "shardit/core/profile.h"
#include "shardit/io/model_folder.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/inputs.h"

namespace shardit::models {

Qwen3Config Qwen3Config::from_json(const nlohmann::json& json, const std::string& source,
                                   const std::vector<std::string>& rope_types) {
  const io::ConfigReader reader(json, source);
  Qwen3Config config;
  config.vocab_size = reader.integer("vocab_size", config.vocab_size, 1, int64_t{1} << 31);
  config.hidden_size = reader.integer("hidden_size", config.hidden_size, 1, io::kMaxConfigDim);
  config.intermediate_size = reader.integer("intermediate_size", config.intermediate_size, 1, io::kMaxConfigDim);
  config.num_hidden_layers = reader.integer("num_hidden_layers", config.num_hidden_layers, 1, io::kMaxConfigLayers);
  config.num_attention_heads = reader.integer("num_attention_heads", config.num_attention_heads, 1, io::kMaxConfigDim);
  config.num_key_value_heads =
      reader.integer("num_key_value_heads", config.num_attention_heads, 1, config.num_attention_heads);
  reader.require(config.num_attention_heads % config.num_key_value_heads == 0, "'num_attention_heads' ",
                 config.num_attention_heads, " is not a multiple of 'num_key_value_heads' ", config.num_key_value_heads);
  const std::optional<int64_t> head_dim = reader.optional_integer("head_dim", 2, io::kMaxConfigDim);
  reader.require(head_dim.has_value() || config.hidden_size % config.num_attention_heads == 0, "'hidden_size' ",
                 config.hidden_size, " is not a multiple of 'num_attention_heads' ", config.num_attention_heads,
                 " and no 'head_dim' is given");
  config.head_dim = head_dim.value_or(config.hidden_size / config.num_attention_heads);
  reader.require(config.head_dim % 2 == 0, "'head_dim' must be even for RoPE, got ", config.head_dim);
  reader.width("num_attention_heads", config.num_attention_heads, "head_dim", config.head_dim);
  config.hidden_act = nn::parse_activation(reader.string("hidden_act", "silu"), source, "hidden_act");
  config.rms_norm_eps = reader.number("rms_norm_eps", config.rms_norm_eps, 1e-30, 1.0);
  config.rope_theta = reader.number("rope_theta", config.rope_theta, 1e-3, 1e12);
  config.attention_bias = reader.boolean("attention_bias", config.attention_bias);
  config.tie_word_embeddings = reader.boolean("tie_word_embeddings", config.tie_word_embeddings);
  const auto optional_bool = [&](const char* key) {
    return json.contains(key) && !json.at(key).is_null() && reader.boolean(key, false);
  };
  reader.require(!optional_bool("use_sliding_window"),
                 "'use_sliding_window' is true; sliding-window attention is not supported (prompts are far "
                 "shorter than any window)");
  if (json.contains("rope_scaling") && !json.at("rope_scaling").is_null()) {
    const nlohmann::json& scaling = json.at("rope_scaling");
    reader.require(scaling.is_object(), "'rope_scaling' must be an object or null, got ", scaling.dump());
    const io::ConfigReader scaling_reader(scaling, source + " (rope_scaling)");
    const std::string type = scaling_reader.string("rope_type", scaling_reader.string("type", "default"));
    reader.require(std::find(rope_types.begin(), rope_types.end(), type) != rope_types.end(), "rope_scaling type '",
                   type, "' is not supported; supported: ", c10::Join(", ", rope_types));
  }
  return config;
}

Qwen3MLP::Qwen3MLP(const Qwen3Config& config) : activation_(config.hidden_act) {
  const auto linear = [](int64_t in, int64_t out) {
    return std::make_shared<nn::Linear>(nn::LinearOptions(in, out).with_bias(false));
  };
  gate_proj = register_module("gate_proj", linear(config.hidden_size, config.intermediate_size));
  up_proj = register_module("up_proj", linear(config.hidden_size, config.intermediate_size));
  down_proj = register_module("down_proj", linear(config.intermediate_size, config.hidden_size));
}

at::Tensor Qwen3MLP::forward(const at::Tensor& x) {
  // [B, S, I_local] -> [B, S, D]
  return down_proj->forward(nn::activate(gate_proj->forward(x), activation_) * up_proj->forward(x));
}

Qwen3Attention::Qwen3Attention(const Qwen3Config& config, bool qk_norm) : head_dim_(config.head_dim) {
  const int64_t d = config.hidden_size;
  const int64_t q_width = config.num_attention_heads * config.head_dim;
  const int64_t kv_width = config.num_key_value_heads * config.head_dim;
  const auto linear = [](int64_t in, int64_t out, bool bias) {
    return std::make_shared<nn::Linear>(nn::LinearOptions(in, out).with_bias(bias));
  };
  q_proj = register_module("q_proj", linear(d, q_width, config.attention_bias));
  k_proj = register_module("k_proj", linear(d, kv_width, config.attention_bias));
  v_proj = register_module("v_proj", linear(d, kv_width, config.attention_bias));
  o_proj = register_module("o_proj", linear(q_width, d, false));
  if (qk_norm) {
    const auto norm = [&] {
      return std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(config.head_dim).with_eps(config.rms_norm_eps));
    };
    q_norm = register_module("q_norm", norm());
    k_norm = register_module("k_norm", norm());
  }
}

at::Tensor Qwen3Attention::forward(const at::Tensor& hidden_states, const nn::RotaryEmbedding& rope,
                                   const at::Tensor& mask, const std::optional<at::Tensor>& row_scale) {
  // q [B, S, H_local, hd], k and v [B, S, H_kv_local, hd]
  const nn::HeadsQKV qkv =
      nn::project_heads(hidden_states, {*q_proj, *k_proj, *v_proj, q_norm.get(), k_norm.get()}, head_dim_);
  // [B, S, H_local * hd]
  at::Tensor attended = nn::attention(qkv, &rope, mask);
  // o_proj has no bias, so a zero row stays zero through it (and through its all-reduce).
  if (row_scale.has_value()) attended = attended * *row_scale;
  // [B, S, D]
  return o_proj->forward(attended);
}

Qwen3DecoderLayer::Qwen3DecoderLayer(const Qwen3Config& config, bool qk_norm) {
  const auto norm = [&] {
    return std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(config.hidden_size).with_eps(config.rms_norm_eps));
  };
  self_attn = register_module("self_attn", std::make_shared<Qwen3Attention>(config, qk_norm));
  mlp = register_module("mlp", std::make_shared<Qwen3MLP>(config));
  input_layernorm = register_module("input_layernorm", norm());
  post_attention_layernorm = register_module("post_attention_layernorm", norm());
}

at::Tensor Qwen3DecoderLayer::forward(const at::Tensor& hidden_states, const nn::RotaryEmbedding& rope,
                                      const at::Tensor& mask, const std::optional<at::Tensor>& row_scale) {
  SHARDIT_PROFILE_SCOPE("Qwen3DecoderLayer");
  const at::Tensor attended =
      hidden_states + self_attn->forward(input_layernorm->forward(hidden_states), rope, mask, row_scale);
  return attended + mlp->forward(post_attention_layernorm->forward(attended));
}

Qwen3Model::Qwen3Model(const Qwen3Config& config, bool qk_norm, std::string type_name,
                       std::optional<int64_t> layers_built)
    : config_(config),
      type_name_(!type_name.empty() ? std::move(type_name) : qk_norm ? "Qwen3Model" : "Qwen2_5_VLTextModel") {
  const int64_t built = layers_built.value_or(config.num_hidden_layers);
  TORCH_CHECK(built >= 1 && built <= config.num_hidden_layers, type_name_, ": cannot build ", built,
              " decoder layers of ", config.num_hidden_layers);
  embed_tokens = register_module("embed_tokens", std::make_shared<nn::Embedding>(config.vocab_size, config.hidden_size));
  layers = register_module("layers", std::make_shared<nn::ModuleList<Qwen3DecoderLayer>>());
  for (int64_t i = 0; i < built; ++i) layers->push_back(std::make_shared<Qwen3DecoderLayer>(config, qk_norm));
  norm = register_module("norm",
                         std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(config.hidden_size).with_eps(config.rms_norm_eps)));
}

DecoderHiddenStates Qwen3Model::forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& key_mask,
                                        const at::Tensor& positions, const std::vector<int64_t>& hidden_states,
                                        bool last_hidden_state) {
  const at::Device device = norm->weight.device();
  // [B, S, D]
  const at::Tensor hidden = embed_tokens->forward(input_ids.to(device, at::kLong));
  // [B or 1, S, hd]
  const nn::RotaryEmbedding rope = nn::rotary_pos_embed_rotate_half(config_.head_dim, positions.to(device), config_.rope_theta);
  return forward_embeds(hidden, key_mask, rope, hidden_states, last_hidden_state);
}

DecoderHiddenStates Qwen3Model::forward_embeds(const at::Tensor& inputs_embeds, const std::optional<at::Tensor>& key_mask,
                                               const nn::RotaryEmbedding& rope, const std::vector<int64_t>& hidden_states,
                                               bool last_hidden_state) {
  const int64_t num_layers = config_.num_hidden_layers;
  int64_t layers_needed = last_hidden_state ? num_layers : 0;
  for (const int64_t index : hidden_states) {
    TORCH_CHECK(index >= 0 && index <= num_layers, type_name(), ": hidden state ", index,
                " does not exist; the model has hidden states 0 (embeddings) to ", num_layers, " (after the final norm)");
    layers_needed = std::max(layers_needed, index);
  }
  const int64_t built = static_cast<int64_t>(layers->size());
  TORCH_CHECK(layers_needed <= built, type_name(), ": ", last_hidden_state ? "the last hidden state" : "hidden state ",
              last_hidden_state ? std::string() : std::to_string(layers_needed), " needs ", layers_needed,
              " decoder layers, but this model was built with its first ", built, " of ", num_layers,
              " only (what its pipeline reads); build it whole to read later hidden states");
  const at::Device device = norm->weight.device();
  const int64_t seq_len = inputs_embeds.size(1);
  // [B, S, D]
  at::Tensor hidden = inputs_embeds;
  // [B or 1, 1, S, S]
  const at::Tensor mask = nn::additive_attention_mask(seq_len, key_mask, /*causal=*/true, hidden.scalar_type(), device);
  std::optional<at::Tensor> row_scale;
  if (keyless_query_rows == KeylessQueryRows::Zero && key_mask.has_value() && key_mask->defined()) {
    // Causal: query i has a key iff some key j <= i is a token. [B, S, 1], 1 or 0
    row_scale = key_mask->to(device).ne(0).to(at::kLong).cumsum(1).gt(0).unsqueeze(-1).to(hidden.scalar_type());
  }

  std::vector<at::Tensor> states{hidden};
  emit("hidden_states.0", hidden);
  for (int64_t i = 0; i < layers_needed; ++i) {
    hidden = (*layers)[i].forward(hidden, rope, mask, row_scale);
    // The last entry of the reference's tuple is the normed output, not the last layer's.
    if (i + 1 < num_layers) {
      states.push_back(hidden);
      emit("hidden_states." + std::to_string(i + 1), hidden);
    }
  }
  DecoderHiddenStates out;
  if (layers_needed == num_layers) {
    const at::Tensor normed = norm->forward(hidden);
    states.push_back(normed);
    emit("hidden_states." + std::to_string(num_layers), normed);
    emit("last_hidden_state", normed);
    if (last_hidden_state) out.last_hidden_state = normed;
  }
  for (const int64_t index : hidden_states) out.hidden_states.push_back(states.at(index));
  return out;
}

parallel::TpPlan qwen_decoder_tp_plan_at(const std::string& prefix) {
  using parallel::ShardStyle;
  // Megatron's split: q/k/v and gate/up colwise, o and down rowwise (one all-reduce each); the
  // token table split by vocabulary (any degree). k/v split by key/value heads while the degree
  // divides them and replicated beyond (qwen_decoder_traits). Replicated: the RMS norms (the
  // q/k norms act on one head).
  return {
      {prefix + "embed_tokens", ShardStyle::Rowwise},
      {prefix + "layers.*.self_attn.q_proj", ShardStyle::Colwise},
      {prefix + "layers.*.self_attn.k_proj", ShardStyle::Colwise},
      {prefix + "layers.*.self_attn.v_proj", ShardStyle::Colwise},
      {prefix + "layers.*.self_attn.o_proj", ShardStyle::Rowwise},
      {prefix + "layers.*.mlp.gate_proj", ShardStyle::Colwise},
      {prefix + "layers.*.mlp.up_proj", ShardStyle::Colwise},
      {prefix + "layers.*.mlp.down_proj", ShardStyle::Rowwise},
  };
}

const parallel::TpPlan& qwen_decoder_tp_plan() {
  static const parallel::TpPlan plan = qwen_decoder_tp_plan_at("model.");
  return plan;
}

parallel::ModelTraits qwen_decoder_traits_at(const Qwen3Config& config, const std::string& prefix,
                                             const std::string& lm_head_key) {
  parallel::ModelTraits traits;
  // A rank holds whole query heads; key/value heads split while the degree divides them and are
  // replicated when the degree is a multiple of them (vLLM), so 4 key/value heads allow TP=8.
  traits.divisors = {{"num_attention_heads", config.num_attention_heads}};
  traits.replicable_heads = {{{prefix + "layers.*.self_attn.k_proj", prefix + "layers.*.self_attn.v_proj"},
                              "num_key_value_heads",
                              config.num_key_value_heads}};
  // The language-model head is not part of the text encoder.
  traits.ignored_checkpoint_keys = {lm_head_key};
  return traits;
}

parallel::ModelTraits qwen_decoder_traits(const Qwen3Config& config) {
  return qwen_decoder_traits_at(config, "model.", "lm_head.weight");
}

Qwen3ForCausalLM::Qwen3ForCausalLM(const Qwen3Config& config) : config(config) {
  model = register_module("model", std::make_shared<Qwen3Model>(config, /*qk_norm=*/true));
}

const parallel::TpPlan& Qwen3ForCausalLM::tp_plan() const { return qwen_decoder_tp_plan(); }

parallel::ModelTraits Qwen3ForCausalLM::traits() const { return qwen_decoder_traits(config); }

DecoderHiddenStates Qwen3ForCausalLM::forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask,
                                              const std::vector<int64_t>& hidden_states, bool last_hidden_state) {
  SHARDIT_PROFILE_SCOPE("Qwen3ForCausalLM");
  const std::string where = type_name();
  TORCH_CHECK(is_materialized(), where, ": forward called before the weights were loaded");
  const auto shape = nn::check_shape(where, "input_ids", input_ids, {"B", "S"});
  TORCH_CHECK(shape[1] >= 1, where, ": input_ids has no tokens");
  if (attention_mask.has_value()) nn::check_shape(where, "attention_mask", *attention_mask, {{"B", shape[0]}, {"S", shape[1]}});
  // [1, S]: arange for every row, whatever the padding
  const at::Tensor positions = at::arange(shape[1], at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  return model->forward(input_ids, attention_mask, positions, hidden_states, last_hidden_state);
}

const std::vector<int64_t>& flux2_klein_hidden_states_layers() {
  static const std::vector<int64_t> layers = {9, 18, 27};
  return layers;
}

at::Tensor flux2_klein_prompt_embeds(Qwen3ForCausalLM& text_encoder, const at::Tensor& input_ids,
                                     const at::Tensor& attention_mask, const std::vector<int64_t>& layers) {
  return stacked_hidden_states(text_encoder, input_ids, attention_mask, layers, "flux2_klein_prompt_embeds");
}

}  // namespace shardit::models
