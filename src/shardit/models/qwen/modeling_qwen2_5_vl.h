#pragma once
// Qwen2.5-VL's text path (transformers' models/qwen2_5_vl/modeling_qwen2_5_vl.py,
// Qwen2_5_VLForConditionalGeneration on text-only input): the Qwen decoder with q/k/v biases and
// no q/k norm. Text-only M-RoPE has three equal position rows, so it is plain rotate-half RoPE
// with positions cumsum(mask) - 1. Qwen-Image's `text_encoder`: its pipeline takes the last
// hidden state, keeps the tokens under the mask and drops the template prefix. The vision tower
// and lm_head are not loaded. Members are named as the checkpoint keys.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/tokenizers/prompt_templates.h"

namespace shardit::models {

/// config.json of Qwen2_5_VLForConditionalGeneration: the text decoder's keys (top level, or under
/// `text_config` as newer transformers write them); rope_scaling "default" or "mrope";
/// attention_bias is always true (q/k/v biases).
Qwen3Config qwen2_5_vl_text_config_from_json(const nlohmann::json& json, const std::string& source);

/// transformers' Qwen2_5_VLForConditionalGeneration, text path: `model.*` (checkpoints written by
/// transformers >= 4.52 name it `model.language_model.*`; both are read).
class Qwen2_5_VLForConditionalGeneration : public parallel::TensorParallelModule {
 public:
  explicit Qwen2_5_VLForConditionalGeneration(const Qwen3Config& config);
  std::string type_name() const override { return "Qwen2_5_VLForConditionalGeneration"; }
  const parallel::TpPlan& tp_plan() const override;
  parallel::ModelTraits traits() const override;

  /// input_ids (integer) [B, S], attention_mask (optional, [B, S], 1 = token). Positions are
  /// cumsum(mask) - 1 (1 at padding), arange(S) without a mask. Returns hidden states as
  /// Qwen3Model::forward; also emits position_ids [3, B, S].
  DecoderHiddenStates forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask,
                              const std::vector<int64_t>& hidden_states = {}, bool last_hidden_state = true);

  at::ScalarType dtype() const { return model->norm->weight.scalar_type(); }
  at::Device device() const { return model->norm->weight.device(); }

  const Qwen3Config config;
  std::shared_ptr<Qwen3Model> model;

 private:
  std::vector<std::pair<std::string, std::vector<std::string>>> key_aliases_;
};

/// transformers' text-only position ids: cumsum(mask) - 1, 1 where the mask is 0. [B, S] int64.
at::Tensor qwen2_5_vl_text_position_ids(const at::Tensor& attention_mask);

/// Qwen-Image's prompt embeddings and their mask.
struct QwenImagePromptEmbeds {
  at::Tensor prompt_embeds;       ///< [B, L_max, D], zero rows after each prompt's end
  at::Tensor prompt_embeds_mask;  ///< [B, L_max] int64, 1 on the prompt's tokens
};

/// QwenImagePipeline._get_qwen_prompt_embeds after tokenizing (tokenizers::
/// encode_qwenimage_prompts): the last hidden state's rows under the mask, without the first
/// `drop_idx` (the template prefix), right-padded with zeros to the longest.
QwenImagePromptEmbeds qwenimage_prompt_embeds(Qwen2_5_VLForConditionalGeneration& text_encoder,
                                              const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                              int64_t drop_idx = tokenizers::kQwenImageDropIdx);

/// The post-processing alone: `last_hidden_state` [B, S, D] and its `attention_mask` [B, S].
QwenImagePromptEmbeds qwenimage_prompt_embeds_from_hidden(const at::Tensor& last_hidden_state,
                                                          const at::Tensor& attention_mask,
                                                          int64_t drop_idx = tokenizers::kQwenImageDropIdx);

}  // namespace shardit::models
