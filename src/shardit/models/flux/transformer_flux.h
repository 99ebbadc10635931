#pragma once
// FLUX.1 transformer (diffusers' models/transformers/transformer_flux.py): 19 double-stream
// blocks with separate text/image weights and joint attention, 38 single-stream blocks over the
// joint [text; image] sequence, AdaLN-Zero modulation from the timestep/guidance/pooled-text
// embedding, and 3-axis RoPE. Members are named as the checkpoint keys.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/joint_transformer.h"
#include "shardit/models/single_file.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/timestep_embeddings.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/nn/norms.h"
#include "shardit/nn/rope.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::models {

/// config.json of FluxTransformer2DModel (same keys, same defaults as diffusers).
struct FluxTransformer2DModelConfig {
  int64_t patch_size = 1;
  int64_t in_channels = 64;
  std::optional<int64_t> out_channels;  ///< null: in_channels
  int64_t num_layers = 19;
  int64_t num_single_layers = 38;
  int64_t attention_head_dim = 128;
  int64_t num_attention_heads = 24;
  int64_t joint_attention_dim = 4096;
  int64_t pooled_projection_dim = 768;
  bool guidance_embeds = false;
  std::vector<int64_t> axes_dims_rope = {16, 56, 56};

  /// Parses and validates a config.json object; `source` names the file in errors.
  static FluxTransformer2DModelConfig from_json(const nlohmann::json& json, const std::string& source);

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  int64_t resolved_out_channels() const { return out_channels.value_or(in_channels); }
};

/// normalization.py AdaLayerNormZero: linear(silu(emb)) -> [shift, scale, gate] for attention and
/// for the MLP; returns LN(x) * (1 + scale_msa) + shift_msa and the other four.
class AdaLayerNormZero : public nn::Module {
 public:
  explicit AdaLayerNormZero(int64_t embedding_dim);
  std::string type_name() const override { return "AdaLayerNormZero"; }

  struct Output {
    at::Tensor hidden_states;  ///< [B, S, D]
    at::Tensor gate_msa, shift_mlp, scale_mlp, gate_mlp;  ///< [B, D] each
    at::Tensor emb;            ///< the linear's output [B, 6D]
  };
  Output forward(const at::Tensor& x, const at::Tensor& emb);

  std::shared_ptr<nn::Linear> linear;  ///< D -> 6D
};

/// normalization.py AdaLayerNormZeroSingle: [shift, scale, gate]; returns the modulated LN(x).
class AdaLayerNormZeroSingle : public nn::Module {
 public:
  explicit AdaLayerNormZeroSingle(int64_t embedding_dim);
  std::string type_name() const override { return "AdaLayerNormZeroSingle"; }

  struct Output {
    at::Tensor hidden_states;  ///< [B, S, D]
    at::Tensor gate;           ///< [B, D]
    at::Tensor emb;            ///< the linear's output [B, 3D]
  };
  Output forward(const at::Tensor& x, const at::Tensor& emb);

  std::shared_ptr<nn::Linear> linear;  ///< D -> 3D
};

/// embeddings.py CombinedTimestepTextProjEmbeddings (FLUX.1 [schnell]) and
/// CombinedTimestepGuidanceTextProjEmbeddings (FLUX.1 [dev], `with_guidance`):
/// timestep_embedder(proj(t)) [+ guidance_embedder(proj(g))] + text_embedder(pooled).
class CombinedTimestepGuidanceTextProjEmbeddings : public nn::Module {
 public:
  CombinedTimestepGuidanceTextProjEmbeddings(int64_t embedding_dim, int64_t pooled_projection_dim, bool with_guidance);
  std::string type_name() const override {
    return guidance_embedder ? "CombinedTimestepGuidanceTextProjEmbeddings" : "CombinedTimestepTextProjEmbeddings";
  }
  /// timestep and guidance [B] already scaled by 1000 (fp32); pooled [B, P] -> temb [B, D].
  at::Tensor forward(const at::Tensor& timestep, const std::optional<at::Tensor>& guidance,
                     const at::Tensor& pooled_projection);

  nn::Timesteps time_proj;  ///< 256 channels, cos first, no shift
  std::shared_ptr<nn::TimestepEmbedding> timestep_embedder;
  std::shared_ptr<nn::TimestepEmbedding> guidance_embedder;  ///< null without guidance
  std::shared_ptr<nn::PixArtAlphaTextProjection> text_embedder;
};

/// diffusers' FluxAttention with FluxAttnProcessor: per-head RMS-normed q/k, RoPE, and (double
/// blocks) joint attention over [text; image] with separate text projections. The local head
/// count comes from the projected tensor, so colwise-sharded projections just work.
struct FluxAttentionOptions {
  int64_t query_dim;
  int64_t heads;
  int64_t dim_head;
  /// Width of the text stream with its own projections (add_*_proj, to_add_out); 0: none.
  int64_t added_kv_proj_dim = 0;
  /// No output projection (single blocks feed attention into proj_out themselves).
  bool pre_only = false;
  double eps = 1e-6;
};

class FluxAttention : public nn::Module {
 public:
  explicit FluxAttention(const FluxAttentionOptions& options);
  std::string type_name() const override { return "FluxAttention"; }

  struct Output {
    at::Tensor hidden_states;          ///< image stream [B, N, D] (joint [B, S, D_local] if pre_only)
    at::Tensor encoder_hidden_states;  ///< text stream [B, L, D]; undefined without added_kv_proj_dim
  };
  /// hidden_states [B, N, D]; encoder_hidden_states [B, L, D] (double blocks only); rope tables
  /// for the [text; image] sequence [L + N, head_dim].
  Output forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                 const nn::RotaryEmbedding& rope);

  std::shared_ptr<nn::RMSNorm> norm_q, norm_k;
  std::shared_ptr<nn::Linear> to_q, to_k, to_v;
  std::shared_ptr<nn::ModuleList<nn::Linear>> to_out;  ///< to_out.0 (to_out.1 is a dropout)
  std::shared_ptr<nn::RMSNorm> norm_added_q, norm_added_k;
  std::shared_ptr<nn::Linear> add_q_proj, add_k_proj, add_v_proj;
  std::shared_ptr<nn::Linear> to_add_out;

 private:
  FluxAttentionOptions options_;
};

/// The double-stream block: text and image streams with their own modulation, projections and
/// feed-forwards, one joint attention.
class FluxTransformerBlock : public nn::Module {
 public:
  FluxTransformerBlock(int64_t dim, int64_t num_attention_heads, int64_t attention_head_dim);
  std::string type_name() const override { return "FluxTransformerBlock"; }

  /// hidden_states [B, N, D], encoder_hidden_states [B, L, D], temb [B, D].
  /// Returns {encoder_hidden_states, hidden_states}, as the reference.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                            const at::Tensor& temb, const nn::RotaryEmbedding& rope);

  std::shared_ptr<AdaLayerNormZero> norm1, norm1_context;
  std::shared_ptr<FluxAttention> attn;
  std::shared_ptr<nn::FeedForward> ff, ff_context;
};

/// The single-stream block over the joint [text; image] sequence:
/// x + gate * proj_out(cat[attn(LN'(x)), gelu_tanh(proj_mlp(LN'(x)))]).
class FluxSingleTransformerBlock : public nn::Module {
 public:
  FluxSingleTransformerBlock(int64_t dim, int64_t num_attention_heads, int64_t attention_head_dim,
                             double mlp_ratio = 4.0);
  std::string type_name() const override { return "FluxSingleTransformerBlock"; }

  /// hidden_states [B, L + N, D] (text first), temb [B, D] -> [B, L + N, D].
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& temb, const nn::RotaryEmbedding& rope);

  std::shared_ptr<AdaLayerNormZeroSingle> norm;
  std::shared_ptr<nn::Linear> proj_mlp;
  std::shared_ptr<nn::Linear> proj_out;  ///< input columns [attn D | mlp 4D]
  std::shared_ptr<FluxAttention> attn;
};

/// The arguments of FluxTransformer2DModel.forward, as the pipeline passes them.
struct FluxTransformer2DModelInputs {
  at::Tensor hidden_states;          ///< [B, N, in_channels] packed latents
  at::Tensor encoder_hidden_states;  ///< [B, L, joint_attention_dim]
  at::Tensor pooled_projections;     ///< [B, pooled_projection_dim]
  at::Tensor timestep;               ///< [B] (or a scalar), t/1000; the model multiplies by 1000
  at::Tensor img_ids;                ///< [N, 3] (a [B, N, 3] tensor is accepted; [0] is used)
  at::Tensor txt_ids;                ///< [L, 3] (likewise)
  std::optional<at::Tensor> guidance;  ///< [B] guidance scale (e.g. 3.5), also x1000 inside; required iff guidance_embeds

  /// Read from a case file, by argument name (`guidance` optional).
  static FluxTransformer2DModelInputs from_file(const io::SafetensorsFile& file);
};

/// The skeleton of its forward, norm_out / proj_out and traits() come from
/// JointTransformer2DModel.
class FluxTransformer2DModel : public JointTransformer2DModel {
 public:
  explicit FluxTransformer2DModel(const FluxTransformer2DModelConfig& config);
  std::string type_name() const override { return "FluxTransformer2DModel"; }

  const parallel::TpPlan& tp_plan() const override;
  /// How its single files name its tensors (a registry row carries them; models/single_file.h).
  static const std::vector<SingleFileLayout>& single_file_layouts();

  std::vector<std::string> high_precision_modules() const override;
  /// diffusers' `_tp_plan` for this class, entry for entry (modulation replicated).
  const parallel::TpPlan* reference_tp_plan() const override;
  /// Image and text tokens and their ids split along the sequence, the sample gathered.
  const parallel::CpPlan* cp_plan() const override;
  StepModel step_model(const StepShape& shape) const override;
  at::Tensor forward_from_file(const io::SafetensorsFile& inputs) override;
  const LoraKeyConventions& lora_conventions() const override;
  BlockCounts block_counts() const override {
    return {static_cast<int64_t>(transformer_blocks->size()), static_cast<int64_t>(single_transformer_blocks->size())};
  }

  /// One denoiser evaluation; returns the sample [B, N, patch_size^2 * out_channels] in the
  /// model's dtype. Intermediates go to Module::emit (x_embedder, temb.*, rope.*, block.*, and
  /// the blocks' own).
  at::Tensor forward(const FluxTransformer2DModelInputs& inputs);

  const FluxTransformer2DModelConfig config;

  nn::FluxPosEmbed pos_embed;
  std::shared_ptr<CombinedTimestepGuidanceTextProjEmbeddings> time_text_embed;
  std::shared_ptr<nn::Linear> context_embedder;
  std::shared_ptr<nn::Linear> x_embedder;
  std::shared_ptr<nn::ModuleList<FluxTransformerBlock>> transformer_blocks;
  std::shared_ptr<nn::ModuleList<FluxSingleTransformerBlock>> single_transformer_blocks;
  // norm_out, proj_out: JointTransformer2DModel's members, registered here.
};

}  // namespace shardit::models
