#pragma once
// Qwen3's decoder as a text encoder (transformers' models/qwen3/modeling_qwen3.py,
// Qwen3ForCausalLM without its head): token embeddings, pre-norm decoder layers with grouped-query
// attention, per-head q/k RMSNorm before rotate-half RoPE (theta from the config), SiLU-gated
// MLPs, a final RMSNorm. FLUX.2 [klein]'s `text_encoder`: its pipeline stacks the hidden states of
// layers 9, 18 and 27. Members are named as the checkpoint keys.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/nn/activations.h"
#include "shardit/nn/embedding.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/nn/norms.h"
#include "shardit/nn/rope.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::models {

/// The text-decoder keys of config.json shared by Qwen3Config and Qwen2.5-VL's text config (same
/// keys, same defaults as transformers' Qwen3Config).
struct Qwen3Config {
  int64_t vocab_size = 151936;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 22016;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t head_dim = 128;
  nn::Activation hidden_act = nn::Activation::SiLU;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool attention_bias = false;
  bool tie_word_embeddings = false;

  /// `source` names the file in errors. `rope_types` lists the accepted rope_scaling types
  /// (Qwen3: default; Qwen2.5-VL: default, mrope).
  static Qwen3Config from_json(const nlohmann::json& json, const std::string& source,
                               const std::vector<std::string>& rope_types = {"default"});
};

/// What attention gives a query row that may attend to no key: under the causal + key-padding
/// mask, a row of LEFT padding (every key up to it is padding). Real tokens never see padding
/// keys, so only those rows differ; they reach the output where a pipeline keeps padding rows
/// (FLUX.2 [dev]). See docs/tensor-parallel.md.
enum class KeylessQueryRows {
  /// transformers' eager attention: finfo.min on every score of the row, so the softmax is
  /// uniform over all keys and the row gets the mean of every position's value.
  Uniform,
  /// transformers' SDPA path on torch >= 2.5 (a boolean mask row of all False): zero attention
  /// output; the row still takes the residual and the MLP.
  Zero,
};

/// Qwen3MLP (= Qwen2MLP): down_proj(act(gate_proj(x)) * up_proj(x)), no biases.
class Qwen3MLP : public nn::Module {
 public:
  explicit Qwen3MLP(const Qwen3Config& config);
  std::string type_name() const override { return "Qwen3MLP"; }
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<nn::Linear> gate_proj, up_proj, down_proj;

 private:
  nn::Activation activation_;
};

/// Qwen3Attention: q/k/v projections (biases when attention_bias), q and k RMS-normed per head
/// (`qk_norm`; Qwen2.5-VL has none), RoPE, grouped-query attention, o_proj.
class Qwen3Attention : public nn::Module {
 public:
  Qwen3Attention(const Qwen3Config& config, bool qk_norm);
  std::string type_name() const override { return "Qwen3Attention"; }
  /// [B, S, D], RoPE tables [B or 1, S, head_dim], additive mask [B or 1, 1, S, S] -> [B, S, D].
  /// `row_scale` (optional, [B, S, 1], 0 or 1) multiplies each query row's attention output
  /// before o_proj (KeylessQueryRows::Zero).
  at::Tensor forward(const at::Tensor& hidden_states, const nn::RotaryEmbedding& rope, const at::Tensor& mask,
                     const std::optional<at::Tensor>& row_scale = std::nullopt);

  std::shared_ptr<nn::Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<nn::RMSNorm> q_norm, k_norm;  ///< null without qk_norm

 private:
  int64_t head_dim_;
};

/// Qwen3DecoderLayer: x + attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)).
class Qwen3DecoderLayer : public nn::Module {
 public:
  Qwen3DecoderLayer(const Qwen3Config& config, bool qk_norm);
  std::string type_name() const override { return "Qwen3DecoderLayer"; }
  /// See Qwen3Attention::forward.
  at::Tensor forward(const at::Tensor& hidden_states, const nn::RotaryEmbedding& rope, const at::Tensor& mask,
                     const std::optional<at::Tensor>& row_scale = std::nullopt);

  std::shared_ptr<Qwen3Attention> self_attn;
  std::shared_ptr<Qwen3MLP> mlp;
  std::shared_ptr<nn::RMSNorm> input_layernorm;
  std::shared_ptr<nn::RMSNorm> post_attention_layernorm;
};

/// The hidden states a decoder forward returns.
struct DecoderHiddenStates {
  /// After the final norm ([B, S, D]); undefined when not requested.
  at::Tensor last_hidden_state;
  /// The requested entries of transformers' `hidden_states` tuple, in request order: 0 = the
  /// embeddings, i = the output of layer i - 1, num_hidden_layers = after the final norm.
  std::vector<at::Tensor> hidden_states;
};

/// Qwen3Model: embed_tokens, layers, norm. `qk_norm` false gives Qwen2.5-VL's text model and
/// Mistral's (MistralModel: the same layers without biases; `type_name` names it). With
/// `layers_built` only the first that many decoder layers exist (a pipeline that reads no later
/// hidden state need not hold the rest); hidden states past them are refused.
class Qwen3Model : public nn::Module {
 public:
  Qwen3Model(const Qwen3Config& config, bool qk_norm, std::string type_name = "",
             std::optional<int64_t> layers_built = std::nullopt);
  std::string type_name() const override { return type_name_; }

  /// input_ids [B, S]; key_mask (optional, [B, S], 1 = token) masks padded keys on top of the
  /// causal mask; positions [B or 1, S] (integer). Runs only as many layers as the requested
  /// hidden states need (all of them for the last hidden state). Emits every hidden state it
  /// computes as hidden_states.<i>, and last_hidden_state.
  DecoderHiddenStates forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& key_mask,
                              const at::Tensor& positions, const std::vector<int64_t>& hidden_states,
                              bool last_hidden_state);
  /// The same from the embeddings `inputs_embeds` [B, S, D] (on the model's device) and RoPE
  /// tables already made (Qwen2.5-VL's M-RoPE).
  DecoderHiddenStates forward_embeds(const at::Tensor& inputs_embeds, const std::optional<at::Tensor>& key_mask,
                                     const nn::RotaryEmbedding& rope, const std::vector<int64_t>& hidden_states,
                                     bool last_hidden_state);

  std::shared_ptr<nn::Embedding> embed_tokens;
  std::shared_ptr<nn::ModuleList<Qwen3DecoderLayer>> layers;
  std::shared_ptr<nn::RMSNorm> norm;
  /// The rule for query rows with no key (KeylessQueryRows::Uniform, the eager reference, unless
  /// the model's pipeline was made with the other).
  KeylessQueryRows keyless_query_rows = KeylessQueryRows::Uniform;

 private:
  Qwen3Config config_;
  std::string type_name_;
};

/// The plan of a Qwen-style decoder under `model.`, and its traits (head divisors, key/value
/// heads split or replicated), shared by Qwen3 and Qwen2.5-VL's text model.
const parallel::TpPlan& qwen_decoder_tp_plan();
parallel::ModelTraits qwen_decoder_traits(const Qwen3Config& config);
/// The same plan and traits for the decoder at `prefix` (e.g. "language_model.model."); the
/// traits ignore `lm_head_key`.
parallel::TpPlan qwen_decoder_tp_plan_at(const std::string& prefix);
parallel::ModelTraits qwen_decoder_traits_at(const Qwen3Config& config, const std::string& prefix,
                                             const std::string& lm_head_key);

/// transformers' Qwen3ForCausalLM as a text encoder: `model.*` only; `lm_head.weight` (stored
/// by untied checkpoints) is not loaded.
class Qwen3ForCausalLM : public parallel::TensorParallelModule {
 public:
  explicit Qwen3ForCausalLM(const Qwen3Config& config);
  std::string type_name() const override { return "Qwen3ForCausalLM"; }
  const parallel::TpPlan& tp_plan() const override;
  parallel::ModelTraits traits() const override;

  /// input_ids (integer) [B, S], attention_mask (optional, [B, S], 1 = token); positions are
  /// arange(S) for every row, as transformers gives them. See Qwen3Model::forward for
  /// `hidden_states`; the last hidden state is computed only when `last_hidden_state`.
  DecoderHiddenStates forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask,
                              const std::vector<int64_t>& hidden_states = {}, bool last_hidden_state = true);

  at::ScalarType dtype() const { return model->norm->weight.scalar_type(); }
  at::Device device() const { return model->norm->weight.device(); }

  const Qwen3Config config;
  std::shared_ptr<Qwen3Model> model;
};

/// The FLUX.2 pipelines' prompt embeddings from a decoder text encoder (`Encoder::forward` as
/// Qwen3ForCausalLM's): hidden_states `layers` of the tokens, per token [hs[l_0] | hs[l_1] | ...],
/// [B, S, len(layers) * D]; runs only the layers the stack needs. `what` names the caller in errors.
template <class Encoder>
at::Tensor stacked_hidden_states(Encoder& text_encoder, const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                 const std::vector<int64_t>& layers, const char* what) {
  TORCH_CHECK(!layers.empty(), what, ": no hidden-state layers given");
  const DecoderHiddenStates out = text_encoder.forward(input_ids, attention_mask, layers, /*last_hidden_state=*/false);
  // stack(dim=1).permute(0, 2, 1, 3).reshape(B, S, n * D) is, per token, the layers side by side
  // [B, S, n * D]
  return at::cat(out.hidden_states, -1);
}

/// Flux2KleinPipeline's layers: hidden_states 9, 18 and 27.
const std::vector<int64_t>& flux2_klein_hidden_states_layers();

/// Flux2KleinPipeline._get_qwen3_prompt_embeds after tokenizing (tokenizers::
/// encode_flux2_klein_prompts): per token [hs[l_0] | hs[l_1] | ...], [B, S, len(layers) * D].
/// Runs only the layers the stack needs.
at::Tensor flux2_klein_prompt_embeds(Qwen3ForCausalLM& text_encoder, const at::Tensor& input_ids,
                                     const at::Tensor& attention_mask,
                                     const std::vector<int64_t>& layers = flux2_klein_hidden_states_layers());

}  // namespace shardit::models
