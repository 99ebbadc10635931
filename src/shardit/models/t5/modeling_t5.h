#pragma once
// T5's encoder (transformers' models/t5/modeling_t5.py, T5EncoderModel): token embeddings (no
// scaling), pre-norm blocks of self-attention without score scaling plus a relative position
// bias computed once by block 0 and shared by every block, a (gated-)activation feed-forward, and
// RMS norms without mean or bias. FLUX.1's `text_encoder_2` (T5 v1.1 XXL). Members are named as
// the checkpoint keys; `encoder.embed_tokens` is tied to `shared`.
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

/// config.json of T5EncoderModel (T5Config: same keys, same defaults as transformers).
struct T5Config {
  int64_t vocab_size = 32128;
  int64_t d_model = 512;
  int64_t d_kv = 64;
  int64_t d_ff = 2048;
  int64_t num_layers = 6;
  int64_t num_heads = 8;
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6;
  /// From `feed_forward_proj`: "gated-gelu" (v1.1: gelu_new, gated), "relu" (v1.0), "gated-<act>".
  bool is_gated_act = false;
  nn::Activation dense_act_fn = nn::Activation::Relu;

  static T5Config from_json(const nlohmann::json& json, const std::string& source);
  int64_t inner_dim() const { return num_heads * d_kv; }
};

/// T5's bidirectional relative position buckets: bucket[i, j] of the offset j - i, exact below
/// num_buckets / 4 and logarithmic up to max_distance (transformers' _relative_position_bucket, in
/// the same fp32 arithmetic). [query_len, key_len] int64.
at::Tensor t5_relative_position_bucket(int64_t query_len, int64_t key_len, int64_t num_buckets, int64_t max_distance,
                                       at::Device device);

/// T5Attention of the encoder: q/k/v/o without bias, scores q k^T (no 1/sqrt(d)) + position bias.
class T5Attention : public nn::Module {
 public:
  T5Attention(const T5Config& config, bool has_relative_attention_bias);
  std::string type_name() const override { return "T5Attention"; }
  /// [B, S, D], bias (position bias + mask) [B or 1, H_local, S, S] -> [B, S, D].
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& bias);
  /// The position bias [1, H_local, S, S] (block 0 only).
  at::Tensor compute_bias(int64_t seq_len);

  std::shared_ptr<nn::Linear> q, k, v, o;
  std::shared_ptr<nn::Embedding> relative_attention_bias;  ///< [num_buckets, H]; null except in block 0

 private:
  T5Config config_;
};

/// T5LayerSelfAttention: x + SelfAttention(layer_norm(x)).
class T5LayerSelfAttention : public nn::Module {
 public:
  T5LayerSelfAttention(const T5Config& config, bool has_relative_attention_bias);
  std::string type_name() const override { return "T5LayerSelfAttention"; }
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& bias);

  std::shared_ptr<T5Attention> SelfAttention;  // NOLINT: the checkpoint's name
  std::shared_ptr<nn::RMSNorm> layer_norm;
};

/// T5DenseGatedActDense (wo(act(wi_0 x) * wi_1 x)) or T5DenseActDense (wo(act(wi x))).
class T5DenseActDense : public nn::Module {
 public:
  explicit T5DenseActDense(const T5Config& config);
  std::string type_name() const override { return gated_ ? "T5DenseGatedActDense" : "T5DenseActDense"; }
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<nn::Linear> wi;    ///< not gated
  std::shared_ptr<nn::Linear> wi_0;  ///< gated: the activated half
  std::shared_ptr<nn::Linear> wi_1;  ///< gated: the linear half
  std::shared_ptr<nn::Linear> wo;    ///< kept in fp32 (transformers' _keep_in_fp32_modules)

 private:
  bool gated_;
  nn::Activation activation_;
};

/// T5LayerFF: x + DenseReluDense(layer_norm(x)).
class T5LayerFF : public nn::Module {
 public:
  explicit T5LayerFF(const T5Config& config);
  std::string type_name() const override { return "T5LayerFF"; }
  at::Tensor forward(const at::Tensor& hidden_states);

  std::shared_ptr<T5DenseActDense> DenseReluDense;  // NOLINT: the checkpoint's name
  std::shared_ptr<nn::RMSNorm> layer_norm;
};

/// T5Block of the encoder: `layer.0` self-attention, `layer.1` feed-forward.
class T5Block : public nn::Module {
 public:
  T5Block(const T5Config& config, bool has_relative_attention_bias);
  std::string type_name() const override { return "T5Block"; }
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& bias);

  /// torch.nn.ModuleList `layer` of two different types, registered as "0" and "1".
  class Layers : public nn::Module {
   public:
    std::string type_name() const override { return "ModuleList"; }
    std::shared_ptr<T5LayerSelfAttention> self_attention;  ///< layer.0
    std::shared_ptr<T5LayerFF> feed_forward;               ///< layer.1
   private:
    friend class T5Block;
    template <class M>
    std::shared_ptr<M> add(const std::string& name, std::shared_ptr<M> module) {
      return register_module(name, std::move(module));
    }
  };
  std::shared_ptr<Layers> layer;
};

/// T5Stack of the encoder: blocks and the final norm (embed_tokens is the model's `shared`).
class T5Stack : public nn::Module {
 public:
  explicit T5Stack(const T5Config& config);
  std::string type_name() const override { return "T5Stack"; }
  std::shared_ptr<nn::ModuleList<T5Block>> block;
  std::shared_ptr<nn::RMSNorm> final_layer_norm;
};

/// The longest input T5EncoderModel encodes: the pipelines' longest prompt
/// (pipelines::kMaxSequenceLength).
constexpr int64_t kMaxT5Tokens = 4096;

/// transformers' T5EncoderModel.
class T5EncoderModel : public parallel::TensorParallelModule {
 public:
  explicit T5EncoderModel(const T5Config& config);
  std::string type_name() const override { return "T5EncoderModel"; }
  const parallel::TpPlan& tp_plan() const override;
  parallel::ModelTraits traits() const override;

  /// input_ids (integer) [B, S]; attention_mask (optional, [B, S], 1 = token) masks padded keys
  /// (FLUX.1 passes none). Returns last_hidden_state [B, S, d_model] (after the final norm).
  /// Emits hidden_states.0 (embeddings) ... hidden_states.N (= last_hidden_state; the blocks before
  /// it as their outputs), last_hidden_state, relative_position_bucket and position_bias (block 0's
  /// bias [1, H_local, S, S], without the mask).
  at::Tensor forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask = std::nullopt);

  at::ScalarType dtype() const { return shared->weight.scalar_type(); }
  at::Device device() const { return shared->weight.device(); }

  const T5Config config;
  std::shared_ptr<nn::Embedding> shared;
  std::shared_ptr<T5Stack> encoder;
};

/// FluxPipeline._get_t5_prompt_embeds after tokenizing: last_hidden_state [B, S, d_model] of
/// `input_ids` (T5 tokenizer, padded to max_sequence_length, no attention mask).
at::Tensor flux_t5_prompt_embeds(T5EncoderModel& text_encoder, const at::Tensor& input_ids);

}  // namespace shardit::models
