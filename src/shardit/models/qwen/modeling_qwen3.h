#pragma once
// Qwen3's decoder as a text encoder (transformers' models/qwen3/modeling_qwen3.py,
// Qwen3ForCausalLM without its head): token embeddings, pre-norm decoder layers with grouped-query
// attention, per-head q/k RMSNorm before rotate-half RoPE (theta from the config), SiLU-gated
// MLPs, a final RMSNorm. FLUX.2 [klein]'s `text_encoder`: its pipeline stacks the hidden states of
// layers 9, 18 and 27. Members are named as the checkpoint keys.
#include <ATen/ATen.h>
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
  at::Tensor forward(const at::Tensor& hidden_states, const nn::RotaryEmbedding& rope, const at::Tensor& mask);

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
  at::Tensor forward(const at::Tensor& hidden_states, const nn::RotaryEmbedding& rope, const at::Tensor& mask);

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

/// Qwen3Model: embed_tokens, layers, norm. `qk_norm` false gives Qwen2.5-VL's text model.
class Qwen3Model : public nn::Module {
 public:
  Qwen3Model(const Qwen3Config& config, bool qk_norm);
  std::string type_name() const override { return type_name_; }

  /// input_ids [B, S]; key_mask (optional, [B, S], 1 = token) masks padded keys on top of the
  /// causal mask; positions [B or 1, S] (integer). Runs only as many layers as the requested
  /// hidden states need (all of them for the last hidden state). Emits every hidden state it
  /// computes as hidden_states.<i>, and last_hidden_state.
  DecoderHiddenStates forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& key_mask,
                              const at::Tensor& positions, const std::vector<int64_t>& hidden_states,
                              bool last_hidden_state);

  std::shared_ptr<nn::Embedding> embed_tokens;
  std::shared_ptr<nn::ModuleList<Qwen3DecoderLayer>> layers;
  std::shared_ptr<nn::RMSNorm> norm;

 private:
  Qwen3Config config_;
  std::string type_name_;
};

/// The plan of a Qwen-style decoder under `model.`, and its traits (head divisors, key/value
/// heads split or replicated), shared by Qwen3 and Qwen2.5-VL's text model.
const parallel::TpPlan& qwen_decoder_tp_plan();
parallel::ModelTraits qwen_decoder_traits(const Qwen3Config& config);

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

/// Flux2KleinPipeline's layers: hidden_states 9, 18 and 27.
const std::vector<int64_t>& flux2_klein_hidden_states_layers();

/// Flux2KleinPipeline._get_qwen3_prompt_embeds after tokenizing (tokenizers::
/// encode_flux2_klein_prompts): per token [hs[l_0] | hs[l_1] | ...], [B, S, len(layers) * D].
/// Runs only the layers the stack needs.
at::Tensor flux2_klein_prompt_embeds(Qwen3ForCausalLM& text_encoder, const at::Tensor& input_ids,
                                     const at::Tensor& attention_mask,
                                     const std::vector<int64_t>& layers = flux2_klein_hidden_states_layers());

}  // namespace shardit::models
