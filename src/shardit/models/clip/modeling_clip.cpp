#include "shardit/models/clip/modeling_clip.h"

#include <c10/util/Exception.h>

#include <vector>

#include "shardit/core/profile.h"
#include "shardit/io/model_folder.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/inputs.h"

namespace shardit::models {

CLIPTextConfig CLIPTextConfig::from_json(const nlohmann::json& json, const std::string& source) {
  const io::ConfigReader reader(json, source);
  CLIPTextConfig config;
  config.vocab_size = reader.integer("vocab_size", config.vocab_size, 1, int64_t{1} << 31);
  config.hidden_size = reader.integer("hidden_size", config.hidden_size, 1, io::kMaxConfigDim);
  config.intermediate_size = reader.integer("intermediate_size", config.intermediate_size, 1, io::kMaxConfigDim);
  config.num_hidden_layers = reader.integer("num_hidden_layers", config.num_hidden_layers, 0, io::kMaxConfigLayers);
  config.num_attention_heads = reader.integer("num_attention_heads", config.num_attention_heads, 1, io::kMaxConfigDim);
  config.max_position_embeddings =
      reader.integer("max_position_embeddings", config.max_position_embeddings, 1, io::kMaxConfigDim);
  config.hidden_act = nn::parse_activation(reader.string("hidden_act", "quick_gelu"), source, "hidden_act");
  config.layer_norm_eps = reader.number("layer_norm_eps", config.layer_norm_eps, 1e-30, 1.0);
  config.eos_token_id = reader.integer("eos_token_id", config.eos_token_id, 0, int64_t{1} << 31);
  reader.require(config.hidden_size % config.num_attention_heads == 0, "'hidden_size' ", config.hidden_size,
                 " is not a multiple of 'num_attention_heads' ", config.num_attention_heads);
  return config;
}

CLIPAttention::CLIPAttention(const CLIPTextConfig& config) : head_dim_(config.head_dim()) {
  const int64_t d = config.hidden_size;
  k_proj = register_module("k_proj", std::make_shared<nn::Linear>(nn::LinearOptions(d, d)));
  v_proj = register_module("v_proj", std::make_shared<nn::Linear>(nn::LinearOptions(d, d)));
  q_proj = register_module("q_proj", std::make_shared<nn::Linear>(nn::LinearOptions(d, d)));
  out_proj = register_module("out_proj", std::make_shared<nn::Linear>(nn::LinearOptions(d, d)));
}

at::Tensor CLIPAttention::forward(const at::Tensor& hidden_states, const at::Tensor& mask) {
  // [B, S, H_local, hd] each
  const nn::HeadsQKV qkv = nn::project_heads(hidden_states, {*q_proj, *k_proj, *v_proj}, head_dim_);
  // [B, S, H_local * hd] -> [B, S, D]
  return out_proj->forward(nn::attention(qkv, nullptr, mask));
}

CLIPMLP::CLIPMLP(const CLIPTextConfig& config) : activation_(config.hidden_act) {
  fc1 = register_module("fc1", std::make_shared<nn::Linear>(nn::LinearOptions(config.hidden_size, config.intermediate_size)));
  fc2 = register_module("fc2", std::make_shared<nn::Linear>(nn::LinearOptions(config.intermediate_size, config.hidden_size)));
}

at::Tensor CLIPMLP::forward(const at::Tensor& x) {
  // [B, S, I_local] -> [B, S, D]
  return fc2->forward(nn::activate(fc1->forward(x), activation_));
}

CLIPEncoderLayer::CLIPEncoderLayer(const CLIPTextConfig& config) {
  const auto norm = [&] {
    return std::make_shared<nn::LayerNorm>(nn::LayerNormOptions(config.hidden_size).with_eps(config.layer_norm_eps));
  };
  self_attn = register_module("self_attn", std::make_shared<CLIPAttention>(config));
  layer_norm1 = register_module("layer_norm1", norm());
  mlp = register_module("mlp", std::make_shared<CLIPMLP>(config));
  layer_norm2 = register_module("layer_norm2", norm());
}

at::Tensor CLIPEncoderLayer::forward(const at::Tensor& hidden_states, const at::Tensor& mask) {
  SHARDIT_PROFILE_SCOPE("CLIPEncoderLayer");
  const at::Tensor attended = hidden_states + self_attn->forward(layer_norm1->forward(hidden_states), mask);
  return attended + mlp->forward(layer_norm2->forward(attended));
}

CLIPTextEmbeddings::CLIPTextEmbeddings(const CLIPTextConfig& config) {
  token_embedding = register_module("token_embedding", std::make_shared<nn::Embedding>(config.vocab_size, config.hidden_size));
  position_embedding = register_module(
      "position_embedding", std::make_shared<nn::Embedding>(config.max_position_embeddings, config.hidden_size));
}

CLIPEncoder::CLIPEncoder(const CLIPTextConfig& config) {
  layers = register_module("layers", std::make_shared<nn::ModuleList<CLIPEncoderLayer>>());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) layers->push_back(std::make_shared<CLIPEncoderLayer>(config));
}

CLIPTextTransformer::CLIPTextTransformer(const CLIPTextConfig& config) {
  embeddings = register_module("embeddings", std::make_shared<CLIPTextEmbeddings>(config));
  encoder = register_module("encoder", std::make_shared<CLIPEncoder>(config));
  final_layer_norm = register_module(
      "final_layer_norm",
      std::make_shared<nn::LayerNorm>(nn::LayerNormOptions(config.hidden_size).with_eps(config.layer_norm_eps)));
}

CLIPTextModel::CLIPTextModel(const CLIPTextConfig& config) : config(config) {
  text_model = register_module("text_model", std::make_shared<CLIPTextTransformer>(config));
}

const parallel::TpPlan& CLIPTextModel::tp_plan() const {
  using parallel::ShardStyle;
  // Megatron's layer split: q/k/v and fc1 colwise (whole heads, a slice of the MLP), closed by
  // rowwise out_proj and fc2 (one all-reduce each). The token table is split by vocabulary
  // (any degree). Replicated: the position table (77 rows) and the LayerNorms.
  static const parallel::TpPlan plan = {
      {"text_model.embeddings.token_embedding", ShardStyle::Rowwise},
      {"text_model.encoder.layers.*.self_attn.q_proj", ShardStyle::Colwise},
      {"text_model.encoder.layers.*.self_attn.k_proj", ShardStyle::Colwise},
      {"text_model.encoder.layers.*.self_attn.v_proj", ShardStyle::Colwise},
      {"text_model.encoder.layers.*.self_attn.out_proj", ShardStyle::Rowwise},
      {"text_model.encoder.layers.*.mlp.fc1", ShardStyle::Colwise},
      {"text_model.encoder.layers.*.mlp.fc2", ShardStyle::Rowwise},
  };
  return plan;
}

parallel::ModelTraits CLIPTextModel::traits() const {
  parallel::ModelTraits traits;
  traits.divisors = {{"num_attention_heads", config.num_attention_heads}};
  // Older exports saved the position-id buffer, which transformers now rebuilds.
  traits.ignored_checkpoint_keys = {"text_model.embeddings.position_ids"};
  return traits;
}

CLIPTextModelOutput CLIPTextModel::forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask) {
  SHARDIT_PROFILE_SCOPE("CLIPTextModel");
  const std::string where = type_name();
  TORCH_CHECK(is_materialized(), where, ": forward called before the weights were loaded");
  const auto shape = nn::check_shape(where, "input_ids", input_ids, {"B", "S"});
  const int64_t seq_len = shape[1];
  TORCH_CHECK(seq_len >= 1 && seq_len <= config.max_position_embeddings, where, ": input_ids has ", seq_len,
              " tokens; the model takes 1 to max_position_embeddings = ", config.max_position_embeddings,
              " (truncate with the tokenizer)");
  if (attention_mask.has_value()) nn::check_shape(where, "attention_mask", *attention_mask, {{"B", shape[0]}, {"S", seq_len}});
  const at::Device device = this->device();
  const at::Tensor ids = input_ids.to(device, at::kLong);

  const at::Tensor positions = at::arange(seq_len, at::TensorOptions().dtype(at::kLong).device(device));
  // [B, S, D]
  at::Tensor hidden = text_model->embeddings->token_embedding->forward(ids) +
                      text_model->embeddings->position_embedding->forward(positions).unsqueeze(0);
  // [B or 1, 1, S, S]
  const at::Tensor mask = nn::additive_attention_mask(seq_len, attention_mask, /*causal=*/true, hidden.scalar_type(), device);
  emit("hidden_states.0", hidden);
  int64_t index = 0;
  for (auto& layer : *text_model->encoder->layers) {
    hidden = layer->forward(hidden, mask);
    emit("hidden_states." + std::to_string(++index), hidden);
  }
  CLIPTextModelOutput out;
  out.last_hidden_state = text_model->final_layer_norm->forward(hidden);
  // [B]: the EOS position by the config's rule
  const at::Tensor eos_index = config.eos_token_id == 2 ? ids.argmax(-1) : ids.eq(config.eos_token_id).to(at::kInt).argmax(-1);
  // [B, D]
  out.pooler_output = out.last_hidden_state
                          .gather(1, eos_index.to(at::kLong).view({shape[0], 1, 1}).expand({shape[0], 1, config.hidden_size}))
                          .squeeze(1);
  emit("last_hidden_state", out.last_hidden_state);
  emit("pooler_output", out.pooler_output);
  return out;
}

at::Tensor flux_clip_prompt_embeds(CLIPTextModel& text_encoder, const at::Tensor& input_ids) {
  return text_encoder.forward(input_ids).pooler_output;
}

}  // namespace shardit::models
