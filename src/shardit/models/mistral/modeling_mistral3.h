#pragma once
// Mistral-3's text path (transformers' models/mistral3/modeling_mistral3.py,
// Mistral3ForConditionalGeneration on text-only input, whose language model is models/mistral's
// MistralForCausalLM): the Qwen-style decoder without biases and without q/k norms, grouped-query
// attention, rotate-half RoPE (theta from the config, 1e9 for Mistral-Small-3.1), positions
// arange(S) for every row. FLUX.2 [dev]'s `text_encoder`: its pipeline stacks the hidden states
// of layers 10, 20 and 30. The Pixtral vision tower, the projector and lm_head are not loaded.
// Members are named as the checkpoint keys (`language_model.model.*`).
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/nn/module.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::models {

/// config.json of Mistral3ForConditionalGeneration: its `text_config` (MistralConfig's keys) as
/// the decoder's config; no biases, no q/k norm. A `sliding_window` is kept for the check that
/// prompts fit in it.
struct Mistral3Config {
  Qwen3Config text_config;
  std::optional<int64_t> sliding_window;
  /// Not from config.json: build only the first N decoder layers (FLUX.2 [dev] reads hidden
  /// states up to 30 of Mistral-Small-3.1's 40); the checkpoint's later layers are read past.
  /// nullopt: all of them.
  std::optional<int64_t> layers_built;

  static Mistral3Config from_json(const nlohmann::json& json, const std::string& source);
};

/// transformers' MistralForCausalLM as the language model: `model.*` (MistralModel); lm_head is
/// not part of the text encoder.
class MistralForCausalLM : public nn::Module {
 public:
  MistralForCausalLM(const Qwen3Config& config, std::optional<int64_t> layers_built);
  std::string type_name() const override { return "MistralForCausalLM"; }

  std::shared_ptr<Qwen3Model> model;
};

/// transformers' Mistral3ForConditionalGeneration, text path: `language_model.model.*`
/// (checkpoints written by transformers >= 4.52 name it `model.language_model.*`; both are read).
/// A query row with no key (left padding) gets a zero attention output (KeylessQueryRows::Zero,
/// what FLUX.2 [dev] users' transformers SDPA path gives); `keyless_query_rows()` switches rules.
class Mistral3ForConditionalGeneration : public parallel::TensorParallelModule {
 public:
  explicit Mistral3ForConditionalGeneration(const Mistral3Config& config);
  std::string type_name() const override { return "Mistral3ForConditionalGeneration"; }
  const parallel::TpPlan& tp_plan() const override;
  parallel::ModelTraits traits() const override;

  /// input_ids (integer) [B, S], attention_mask (optional, [B, S], 1 = token); positions are
  /// arange(S) for every row, whatever the padding (a left-padded row's first token sits at
  /// S - n). See Qwen3Model::forward for `hidden_states`; runs only the layers they need.
  DecoderHiddenStates forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask,
                              const std::vector<int64_t>& hidden_states = {}, bool last_hidden_state = true);

  KeylessQueryRows& keyless_query_rows() { return language_model->model->keyless_query_rows; }
  at::ScalarType dtype() const { return language_model->model->norm->weight.scalar_type(); }
  at::Device device() const { return language_model->model->norm->weight.device(); }

  const Mistral3Config config;
  std::shared_ptr<MistralForCausalLM> language_model;

 private:
  std::vector<std::pair<std::string, std::vector<std::string>>> key_aliases_;
};

/// Flux2Pipeline's layers: hidden_states 10, 20 and 30.
const std::vector<int64_t>& flux2_dev_hidden_states_layers();

/// The text encoder as Flux2Pipeline holds it: `config` with only the decoder layers the stacked
/// hidden states read (layers_built = 30 when the model has more; a quarter of Mistral-Small-3.1's
/// layers are then never loaded).
std::shared_ptr<Mistral3ForConditionalGeneration> flux2_dev_text_encoder(Mistral3Config config);

/// Flux2Pipeline._get_mistral_3_small_prompt_embeds after tokenizing (tokenizers::
/// encode_flux2_dev_prompts): per token [hs[l_0] | hs[l_1] | ...], [B, S, len(layers) * D],
/// padding rows included. Runs only the layers the stack needs (30 of Mistral-Small-3.1's 40).
at::Tensor flux2_dev_prompt_embeds(Mistral3ForConditionalGeneration& text_encoder, const at::Tensor& input_ids,
                                   const at::Tensor& attention_mask,
                                   const std::vector<int64_t>& layers = flux2_dev_hidden_states_layers());

}  // namespace shardit::models
