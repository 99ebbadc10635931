#include "shardit/models/mistral/modeling_mistral3.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "shardit/core/profile.h"
#include "shardit/io/model_folder.h"
#include "shardit/nn/inputs.h"

namespace shardit::models {

namespace {

// Where the decoder sits in the checkpoint.
constexpr const char* kDecoderPrefix = "language_model.model.";
// transformers >= 4.52 saves Mistral3ForConditionalGeneration's text model under this name.
constexpr const char* kNewDecoderPrefix = "model.language_model.";

}  // namespace

Mistral3Config Mistral3Config::from_json(const nlohmann::json& json, const std::string& source) {
  TORCH_CHECK(json.is_object() && json.contains("text_config") && json.at("text_config").is_object(), source,
              ": a Mistral3ForConditionalGeneration config needs a 'text_config' object (the language model's "
              "MistralConfig)");
  const nlohmann::json& text = json.at("text_config");
  const std::string text_source = source + " (text_config)";
  Mistral3Config config;
  config.text_config = Qwen3Config::from_json(text, text_source);
  // MistralAttention has no biases whatever the file says.
  config.text_config.attention_bias = false;
  config.sliding_window = io::ConfigReader(text, text_source).optional_integer("sliding_window", 1, int64_t{1} << 40);
  return config;
}

MistralForCausalLM::MistralForCausalLM(const Qwen3Config& config, std::optional<int64_t> layers_built) {
  model = register_module("model", std::make_shared<Qwen3Model>(config, /*qk_norm=*/false, "MistralModel", layers_built));
}

Mistral3ForConditionalGeneration::Mistral3ForConditionalGeneration(const Mistral3Config& config) : config(config) {
  language_model = register_module("language_model", std::make_shared<MistralForCausalLM>(config.text_config, config.layers_built));
  // The golden rule of FLUX.2 [dev]: transformers' SDPA path, which its users run.
  language_model->model->keyless_query_rows = KeylessQueryRows::Zero;
  const std::string prefix = kDecoderPrefix;
  for (const auto& slot : named_states()) {
    key_aliases_.push_back({slot.name, {kNewDecoderPrefix + slot.name.substr(prefix.size())}});
  }
}

const parallel::TpPlan& Mistral3ForConditionalGeneration::tp_plan() const {
  // The Qwen-style decoder's Megatron plan (vocab-parallel embedding; q/k/v, gate/up colwise; o,
  // down rowwise; key/value heads replicated past their count). FLUX.2 [dev] reads hidden
  // states up to layer 30: flux2_dev_prompt_embeds runs no layer after it, and Flux2Pipeline
  // builds the model with layers_built = 30, so layers 31-40 are neither loaded nor computed
  // (the final norm, D values, is loaded and unused).
  static const parallel::TpPlan plan = qwen_decoder_tp_plan_at(kDecoderPrefix);
  return plan;
}

parallel::ModelTraits Mistral3ForConditionalGeneration::traits() const {
  parallel::ModelTraits traits =
      qwen_decoder_traits_at(config.text_config, kDecoderPrefix, "language_model.lm_head.weight");
  traits.key_aliases = key_aliases_;
  // Not used on text-only prompts (both checkpoint namings).
  for (const char* key : {"lm_head.weight", "vision_tower.*", "multi_modal_projector.*", "model.vision_tower.*",
                          "model.multi_modal_projector.*"}) {
    traits.ignored_checkpoint_keys.push_back(key);
  }
  // The layers not built (layers_built): no hidden state the pipeline reads depends on them.
  for (int64_t i = static_cast<int64_t>(language_model->model->layers->size()); i < config.text_config.num_hidden_layers;
       ++i) {
    for (const std::string prefix : {kDecoderPrefix, kNewDecoderPrefix}) {
      traits.ignored_checkpoint_keys.push_back(prefix + "layers." + std::to_string(i) + ".*");
    }
  }
  return traits;
}

DecoderHiddenStates Mistral3ForConditionalGeneration::forward(const at::Tensor& input_ids,
                                                              const std::optional<at::Tensor>& attention_mask,
                                                              const std::vector<int64_t>& hidden_states,
                                                              bool last_hidden_state) {
  SHARDIT_PROFILE_SCOPE("Mistral3ForConditionalGeneration");
  const std::string where = type_name();
  TORCH_CHECK(is_materialized(), where, ": forward called before the weights were loaded");
  const auto shape = nn::check_shape(where, "input_ids", input_ids, {"B", "S"});
  TORCH_CHECK(shape[1] >= 1, where, ": input_ids has no tokens");
  TORCH_CHECK(!config.sliding_window || shape[1] <= *config.sliding_window, where, ": ", shape[1],
              " tokens exceed the config's sliding_window ", config.sliding_window.value_or(0),
              "; sliding-window attention is not supported, use a shorter max_sequence_length");
  if (attention_mask.has_value()) nn::check_shape(where, "attention_mask", *attention_mask, {{"B", shape[0]}, {"S", shape[1]}});
  // [1, S]: arange for every row, whatever the padding
  const at::Tensor positions = at::arange(shape[1], at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  return language_model->model->forward(input_ids, attention_mask, positions, hidden_states, last_hidden_state);
}

const std::vector<int64_t>& flux2_dev_hidden_states_layers() {
  static const std::vector<int64_t> layers = {10, 20, 30};
  return layers;
}

std::shared_ptr<Mistral3ForConditionalGeneration> flux2_dev_text_encoder(Mistral3Config config) {
  const auto& layers = flux2_dev_hidden_states_layers();
  const int64_t needed = *std::max_element(layers.begin(), layers.end());
  // A smaller model keeps all its layers: the forward names the hidden state it lacks.
  if (needed < config.text_config.num_hidden_layers) config.layers_built = needed;
  return std::make_shared<Mistral3ForConditionalGeneration>(config);
}

at::Tensor flux2_dev_prompt_embeds(Mistral3ForConditionalGeneration& text_encoder, const at::Tensor& input_ids,
                                   const at::Tensor& attention_mask, const std::vector<int64_t>& layers) {
  return stacked_hidden_states(text_encoder, input_ids, attention_mask, layers, "flux2_dev_prompt_embeds");
}

}  // namespace shardit::models
