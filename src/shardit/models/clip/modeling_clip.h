#pragma once
// CLIP's text encoder (transformers' models/clip/modeling_clip.py, CLIPTextModel): token +
// position embeddings, pre-LN encoder layers with a causal mask and quick-GELU MLPs, a final
// LayerNorm, and the pooled output at the EOS position. FLUX.1's `text_encoder`. Members are
// named as the checkpoint keys.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>

#include "shardit/nn/activations.h"
#include "shardit/nn/embedding.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/nn/norms.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::models {

/// config.json of CLIPTextModel (CLIPTextConfig: same keys, same defaults as transformers).
struct CLIPTextConfig {
  int64_t vocab_size = 49408;
  int64_t hidden_size = 512;
  int64_t intermediate_size = 2048;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 8;
  int64_t max_position_embeddings = 77;
  nn::Activation hidden_act = nn::Activation::QuickGelu;
  double layer_norm_eps = 1e-5;
  /// 2 (the legacy configs, FLUX.1's included): pool at argmax(input_ids), where the real EOS id
  /// is the largest; otherwise pool at the first input_ids == eos_token_id.
  int64_t eos_token_id = 49407;

  static CLIPTextConfig from_json(const nlohmann::json& json, const std::string& source);
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
};

/// CLIPAttention: q/k/v/out projections (with biases), softmax(q k^T / sqrt(d) + mask) v.
class CLIPAttention : public nn::Module {
 public:
  explicit CLIPAttention(const CLIPTextConfig& config);
  std::string type_name() const override { return "CLIPAttention"; }
  /// [B, S, D], additive mask [B or 1, 1, S, S] -> [B, S, D].
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& mask);

  std::shared_ptr<nn::Linear> k_proj, v_proj, q_proj, out_proj;

 private:
  int64_t head_dim_;
};

/// CLIPMLP: fc2(act(fc1(x))).
class CLIPMLP : public nn::Module {
 public:
  explicit CLIPMLP(const CLIPTextConfig& config);
  std::string type_name() const override { return "CLIPMLP"; }
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<nn::Linear> fc1, fc2;

 private:
  nn::Activation activation_;
};

/// CLIPEncoderLayer: x + attn(ln1(x)), then x + mlp(ln2(x)).
class CLIPEncoderLayer : public nn::Module {
 public:
  explicit CLIPEncoderLayer(const CLIPTextConfig& config);
  std::string type_name() const override { return "CLIPEncoderLayer"; }
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& mask);

  std::shared_ptr<CLIPAttention> self_attn;
  std::shared_ptr<nn::LayerNorm> layer_norm1;
  std::shared_ptr<CLIPMLP> mlp;
  std::shared_ptr<nn::LayerNorm> layer_norm2;
};

/// CLIPTextEmbeddings: token_embedding(ids) + position_embedding(arange(S)).
class CLIPTextEmbeddings : public nn::Module {
 public:
  explicit CLIPTextEmbeddings(const CLIPTextConfig& config);
  std::string type_name() const override { return "CLIPTextEmbeddings"; }
  std::shared_ptr<nn::Embedding> token_embedding;
  std::shared_ptr<nn::Embedding> position_embedding;
};

/// CLIPEncoder: the layer stack.
class CLIPEncoder : public nn::Module {
 public:
  explicit CLIPEncoder(const CLIPTextConfig& config);
  std::string type_name() const override { return "CLIPEncoder"; }
  std::shared_ptr<nn::ModuleList<CLIPEncoderLayer>> layers;
};

/// CLIPTextTransformer: embeddings, encoder, final_layer_norm.
class CLIPTextTransformer : public nn::Module {
 public:
  explicit CLIPTextTransformer(const CLIPTextConfig& config);
  std::string type_name() const override { return "CLIPTextTransformer"; }
  std::shared_ptr<CLIPTextEmbeddings> embeddings;
  std::shared_ptr<CLIPEncoder> encoder;
  std::shared_ptr<nn::LayerNorm> final_layer_norm;
};

/// What CLIPTextModel returns.
struct CLIPTextModelOutput {
  at::Tensor last_hidden_state;  ///< [B, S, D], after final_layer_norm
  at::Tensor pooler_output;      ///< [B, D], last_hidden_state at each row's EOS position
};

/// transformers' CLIPTextModel (checkpoint keys `text_model.*`).
class CLIPTextModel : public parallel::TensorParallelModule {
 public:
  explicit CLIPTextModel(const CLIPTextConfig& config);
  std::string type_name() const override { return "CLIPTextModel"; }
  const parallel::TpPlan& tp_plan() const override;
  parallel::ModelTraits traits() const override;

  /// input_ids (integer) [B, S] with S <= max_position_embeddings; attention_mask (optional,
  /// [B, S], 1 = token) masks padded keys on top of the causal mask (FLUX.1 passes none).
  /// Emits hidden_states.0 (embeddings) ... hidden_states.N (layer N's output, before the final
  /// norm), last_hidden_state and pooler_output.
  CLIPTextModelOutput forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask = std::nullopt);

  at::ScalarType dtype() const { return text_model->final_layer_norm->weight.scalar_type(); }
  at::Device device() const { return text_model->final_layer_norm->weight.device(); }

  const CLIPTextConfig config;
  std::shared_ptr<CLIPTextTransformer> text_model;
};

/// FluxPipeline._get_clip_prompt_embeds after tokenizing: the pooled output [B, D] of `input_ids`
/// (CLIP tokenizer, padded to 77 with the EOS id, no attention mask).
at::Tensor flux_clip_prompt_embeds(CLIPTextModel& text_encoder, const at::Tensor& input_ids);

}  // namespace shardit::models
