#include "shardit/models/qwen/modeling_qwen2_5_vl.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "shardit/core/profile.h"
#include "shardit/nn/inputs.h"

namespace shardit::models {

Qwen3Config qwen2_5_vl_text_config_from_json(const nlohmann::json& json, const std::string& source) {
  const bool nested = !json.contains("hidden_size") && json.contains("text_config") && json.at("text_config").is_object();
  Qwen3Config config = Qwen3Config::from_json(nested ? json.at("text_config") : json,
                                              nested ? source + " (text_config)" : source, {"default", "mrope"});
  // Qwen2.5-VL's attention always has q/k/v biases (its config has no attention_bias key).
  config.attention_bias = true;
  return config;
}

Qwen2_5_VLForConditionalGeneration::Qwen2_5_VLForConditionalGeneration(const Qwen3Config& config) : config(config) {
  model = register_module("model", std::make_shared<Qwen3Model>(config, /*qk_norm=*/false));
  // transformers >= 4.52 saves the text model as model.language_model.*.
  for (const auto& slot : named_states()) {
    key_aliases_.push_back({slot.name, {"model.language_model." + slot.name.substr(std::string("model.").size())}});
  }
}

const parallel::TpPlan& Qwen2_5_VLForConditionalGeneration::tp_plan() const { return qwen_decoder_tp_plan(); }

parallel::ModelTraits Qwen2_5_VLForConditionalGeneration::traits() const {
  parallel::ModelTraits traits = qwen_decoder_traits(config);
  traits.key_aliases = key_aliases_;
  // The vision tower is not used on text-only prompts.
  traits.ignored_checkpoint_keys.push_back("visual.*");
  traits.ignored_checkpoint_keys.push_back("model.visual.*");
  return traits;
}

at::Tensor qwen2_5_vl_text_position_ids(const at::Tensor& attention_mask) {
  const at::Tensor mask = attention_mask.to(at::kLong);
  return (mask.cumsum(-1) - 1).masked_fill_(mask.eq(0), 1);
}

DecoderHiddenStates Qwen2_5_VLForConditionalGeneration::forward(const at::Tensor& input_ids,
                                                                const std::optional<at::Tensor>& attention_mask,
                                                                const std::vector<int64_t>& hidden_states,
                                                                bool last_hidden_state) {
  SHARDIT_PROFILE_SCOPE("Qwen2_5_VLForConditionalGeneration");
  const std::string where = type_name();
  TORCH_CHECK(is_materialized(), where, ": forward called before the weights were loaded");
  const auto shape = nn::check_shape(where, "input_ids", input_ids, {"B", "S"});
  TORCH_CHECK(shape[1] >= 1, where, ": input_ids has no tokens");
  at::Tensor positions;
  if (attention_mask.has_value()) {
    nn::check_shape(where, "attention_mask", *attention_mask, {{"B", shape[0]}, {"S", shape[1]}});
    // [B, S]
    positions = qwen2_5_vl_text_position_ids(*attention_mask);
  } else {
    // [B, S]
    positions = at::arange(shape[1], at::TensorOptions().dtype(at::kLong)).unsqueeze(0).expand({shape[0], shape[1]});
  }
  // [3, B, S]: temporal, height and width rows are equal for text
  emit("position_ids", positions.unsqueeze(0).expand({3, shape[0], shape[1]}));
  return model->forward(input_ids, attention_mask, positions, hidden_states, last_hidden_state);
}

QwenImagePromptEmbeds qwenimage_prompt_embeds_from_hidden(const at::Tensor& last_hidden_state,
                                                          const at::Tensor& attention_mask, int64_t drop_idx) {
  TORCH_CHECK(drop_idx >= 0, "qwenimage_prompt_embeds: drop_idx must be >= 0, got ", drop_idx);
  const auto shape = nn::check_shape("qwenimage_prompt_embeds", "last_hidden_state", last_hidden_state, {"B", "S", "D"});
  nn::check_shape("qwenimage_prompt_embeds", "attention_mask", attention_mask, {{"B", shape[0]}, {"S", shape[1]}});
  const at::Tensor keep = attention_mask.to(last_hidden_state.device()).ne(0);
  std::vector<at::Tensor> rows;
  int64_t longest = 0;
  for (int64_t b = 0; b < shape[0]; ++b) {
    // [n_b, D]: the tokens under the mask, template prefix dropped
    const at::Tensor valid = last_hidden_state[b].index_select(0, keep[b].nonzero().flatten());
    rows.push_back(valid.slice(0, std::min(drop_idx, valid.size(0))));
    longest = std::max(longest, rows.back().size(0));
  }
  QwenImagePromptEmbeds out;
  out.prompt_embeds = at::zeros({shape[0], longest, shape[2]}, last_hidden_state.options());
  out.prompt_embeds_mask = at::zeros({shape[0], longest}, at::TensorOptions().dtype(at::kLong).device(last_hidden_state.device()));
  for (int64_t b = 0; b < shape[0]; ++b) {
    const int64_t n = rows[b].size(0);
    out.prompt_embeds[b].slice(0, 0, n).copy_(rows[b]);
    out.prompt_embeds_mask[b].slice(0, 0, n).fill_(1);
  }
  return out;
}

QwenImagePromptEmbeds qwenimage_prompt_embeds(Qwen2_5_VLForConditionalGeneration& text_encoder,
                                              const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                              int64_t drop_idx) {
  const DecoderHiddenStates out = text_encoder.forward(input_ids, attention_mask);
  return qwenimage_prompt_embeds_from_hidden(out.last_hidden_state, attention_mask, drop_idx);
}

}  // namespace shardit::models
