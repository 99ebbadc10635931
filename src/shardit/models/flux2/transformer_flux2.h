#pragma once
// FLUX.2 transformer (diffusers' models/transformers/transformer_flux2.py): double-stream blocks
// with joint attention and SwiGLU feed-forwards, "parallel" single-stream blocks whose attention
// q|k|v and MLP input share one fused projection (and whose outputs share one), AdaLN modulation
// computed once per model and shared by all blocks, 4-axis RoPE (theta 2000), no bias anywhere.
// Members are named as the checkpoint keys.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <utility>
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

/// config.json of Flux2Transformer2DModel (same keys, same defaults as diffusers).
struct Flux2Transformer2DModelConfig {
  int64_t patch_size = 1;
  int64_t in_channels = 128;
  std::optional<int64_t> out_channels;  ///< null: in_channels
  int64_t num_layers = 8;
  int64_t num_single_layers = 48;
  int64_t attention_head_dim = 128;
  int64_t num_attention_heads = 48;
  int64_t joint_attention_dim = 15360;
  int64_t timestep_guidance_channels = 256;
  double mlp_ratio = 3.0;
  std::vector<int64_t> axes_dims_rope = {32, 32, 32, 32};
  double rope_theta = 2000.0;
  double eps = 1e-6;
  /// FLUX.2 [dev] embeds the guidance scale; [klein] does not.
  bool guidance_embeds = true;

  /// Parses and validates a config.json object; `source` names the file in errors.
  static Flux2Transformer2DModelConfig from_json(const nlohmann::json& json, const std::string& source);

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  int64_t mlp_hidden_dim() const { return static_cast<int64_t>(static_cast<double>(inner_dim()) * mlp_ratio); }
  int64_t resolved_out_channels() const { return out_channels.value_or(in_channels); }
};

/// [shift, scale, gate] modulation of one sub-block, each [B, D].
struct Flux2ModulationParams {
  at::Tensor shift, scale, gate;
};

/// Flux2Modulation: linear(silu(temb)) -> `mod_param_sets` x [shift, scale, gate].
class Flux2Modulation : public nn::Module {
 public:
  Flux2Modulation(int64_t dim, int64_t mod_param_sets);
  std::string type_name() const override { return "Flux2Modulation"; }

  struct Output {
    std::vector<Flux2ModulationParams> sets;  ///< mod_param_sets entries
    at::Tensor emb;                           ///< the linear's output [B, 3 * sets * D]
  };
  /// temb [B, D].
  Output forward(const at::Tensor& temb);

  std::shared_ptr<nn::Linear> linear;  ///< D -> 3 * sets * D, no bias

 private:
  int64_t mod_param_sets_;
};

/// Flux2TimestepGuidanceEmbeddings: timestep_embedder(proj(t)) [+ guidance_embedder(proj(g))].
class Flux2TimestepGuidanceEmbeddings : public nn::Module {
 public:
  Flux2TimestepGuidanceEmbeddings(int64_t in_channels, int64_t embedding_dim, bool with_guidance);
  std::string type_name() const override { return "Flux2TimestepGuidanceEmbeddings"; }
  /// timestep and guidance [B], already x1000 (fp32) -> temb [B, D] in `dtype`.
  at::Tensor forward(const at::Tensor& timestep, const std::optional<at::Tensor>& guidance, at::ScalarType dtype);

  nn::Timesteps time_proj;  ///< cos first, no shift
  std::shared_ptr<nn::TimestepEmbedding> timestep_embedder;
  std::shared_ptr<nn::TimestepEmbedding> guidance_embedder;  ///< null without guidance
};

/// Flux2FeedForward: linear_out(silu(gate) * up) with linear_in's output [gate M | up M].
class Flux2FeedForward : public nn::Module {
 public:
  Flux2FeedForward(int64_t dim, int64_t inner_dim);
  std::string type_name() const override { return "Flux2FeedForward"; }
  /// [..., dim] -> [..., dim].
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<nn::Linear> linear_in;   ///< dim -> 2M, out_blocks {M, M}
  std::shared_ptr<nn::Linear> linear_out;  ///< M -> dim
};

/// Flux2Attention (double blocks): per-head RMS-normed q/k, joint attention over [text; image]
/// with separate text projections, RoPE. Local head count from the projected width.
class Flux2Attention : public nn::Module {
 public:
  Flux2Attention(int64_t query_dim, int64_t heads, int64_t dim_head, int64_t added_kv_proj_dim, double eps);
  std::string type_name() const override { return "Flux2Attention"; }

  /// hidden_states [B, N, D], encoder_hidden_states [B, L, D], rope for [text; image]
  /// [L + N, head_dim]. Returns {hidden_states [B, N, D], encoder_hidden_states [B, L, D]}.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                            const nn::RotaryEmbedding& rope);

  std::shared_ptr<nn::Linear> to_q, to_k, to_v;
  std::shared_ptr<nn::RMSNorm> norm_q, norm_k;
  std::shared_ptr<nn::ModuleList<nn::Linear>> to_out;  ///< to_out.0 (to_out.1 is a dropout)
  std::shared_ptr<nn::RMSNorm> norm_added_q, norm_added_k;
  std::shared_ptr<nn::Linear> add_q_proj, add_k_proj, add_v_proj;
  std::shared_ptr<nn::Linear> to_add_out;

 private:
  int64_t head_dim_;
};

/// Flux2ParallelSelfAttention (single blocks): one fused projection
/// [q D | k D | v D | gate M | up M], attention and silu(gate) * up side by side, and one fused
/// output projection over [attn D | mlp M].
class Flux2ParallelSelfAttention : public nn::Module {
 public:
  Flux2ParallelSelfAttention(int64_t query_dim, int64_t heads, int64_t dim_head, int64_t mlp_hidden_dim, double eps);
  std::string type_name() const override { return "Flux2ParallelSelfAttention"; }

  /// hidden_states [B, S, D], rope [S, head_dim] -> [B, S, D]. Emits "to_qkv_mlp_proj" (the
  /// fused projection's local output).
  at::Tensor forward(const at::Tensor& hidden_states, const nn::RotaryEmbedding& rope);

  std::shared_ptr<nn::Linear> to_qkv_mlp_proj;  ///< D -> 3D + 2M, out_blocks {D, D, D, M, M}
  std::shared_ptr<nn::RMSNorm> norm_q, norm_k;
  std::shared_ptr<nn::Linear> to_out;           ///< D + M -> D, in_blocks {D, M}

 private:
  int64_t head_dim_;
};

/// The double-stream block: image and text streams with their own projections and FFs, one
/// joint attention; modulation comes from the model (shared by all blocks).
class Flux2TransformerBlock : public nn::Module {
 public:
  Flux2TransformerBlock(int64_t dim, int64_t num_attention_heads, int64_t attention_head_dim, double mlp_ratio,
                        double eps);
  std::string type_name() const override { return "Flux2TransformerBlock"; }

  /// hidden_states [B, N, D], encoder_hidden_states [B, L, D]; mod_img / mod_txt: [attn, mlp]
  /// parameter sets. Returns {encoder_hidden_states, hidden_states}, as the reference.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                            const std::vector<Flux2ModulationParams>& mod_img,
                                            const std::vector<Flux2ModulationParams>& mod_txt,
                                            const nn::RotaryEmbedding& rope);

  // norm1, norm1_context, norm2, norm2_context: LayerNorm without affine parameters.
  std::shared_ptr<Flux2Attention> attn;
  std::shared_ptr<Flux2FeedForward> ff, ff_context;

 private:
  double eps_;
};

/// The single-stream block over the joint [text; image] sequence:
/// x + gate * attn(LN(x) * (1 + scale) + shift).
class Flux2SingleTransformerBlock : public nn::Module {
 public:
  Flux2SingleTransformerBlock(int64_t dim, int64_t num_attention_heads, int64_t attention_head_dim, double mlp_ratio,
                              double eps);
  std::string type_name() const override { return "Flux2SingleTransformerBlock"; }

  /// hidden_states [B, L + N, D] (text first) -> [B, L + N, D].
  at::Tensor forward(const at::Tensor& hidden_states, const Flux2ModulationParams& mod, const nn::RotaryEmbedding& rope);

  // norm: LayerNorm without affine parameters.
  std::shared_ptr<Flux2ParallelSelfAttention> attn;

 private:
  double eps_;
};

/// The arguments of Flux2Transformer2DModel.forward, as the pipeline passes them.
struct Flux2Transformer2DModelInputs {
  at::Tensor hidden_states;          ///< [B, N, in_channels] packed latents
  at::Tensor encoder_hidden_states;  ///< [B, L, joint_attention_dim]
  at::Tensor timestep;               ///< [B] (or a scalar), t/1000; the model multiplies by 1000
  at::Tensor img_ids;                ///< [B, N, 4] or [N, 4] int64; [0] is used
  at::Tensor txt_ids;                ///< [B, L, 4] or [L, 4] int64; [0] is used
  std::optional<at::Tensor> guidance;  ///< [B], also x1000 inside; required iff guidance_embeds

  /// Read from a case file, by argument name (`guidance` optional).
  static Flux2Transformer2DModelInputs from_file(const io::SafetensorsFile& file);
};

/// The skeleton of its forward, norm_out / proj_out and traits() come from
/// JointTransformer2DModel.
class Flux2Transformer2DModel : public JointTransformer2DModel {
 public:
  explicit Flux2Transformer2DModel(const Flux2Transformer2DModelConfig& config);
  std::string type_name() const override { return "Flux2Transformer2DModel"; }

  const parallel::TpPlan& tp_plan() const override;
  /// How its single files name its tensors (a registry row carries them; models/single_file.h).
  static const std::vector<SingleFileLayout>& single_file_layouts();

  std::vector<std::string> high_precision_modules() const override;
  /// diffusers' `_tp_plan` for this class, entry for entry (modulation replicated).
  const parallel::TpPlan* reference_tp_plan() const override;
  /// Image and text tokens and their rotary rows split along the sequence, the sample gathered.
  const parallel::CpPlan* cp_plan() const override;
  StepModel step_model(const StepShape& shape) const override;
  at::Tensor forward_from_file(const io::SafetensorsFile& inputs) override;
  const LoraKeyConventions& lora_conventions() const override;
  BlockCounts block_counts() const override {
    return {static_cast<int64_t>(transformer_blocks->size()), static_cast<int64_t>(single_transformer_blocks->size())};
  }

  /// One denoiser evaluation; returns the sample [B, N, patch_size^2 * out_channels] in the
  /// model's dtype. Intermediates go to Module::emit (x_embedder, context_embedder, temb.*, mod.*,
  /// rope.*, block.*, norm_out.*, and the blocks' own).
  at::Tensor forward(const Flux2Transformer2DModelInputs& inputs);

  const Flux2Transformer2DModelConfig config;

  nn::FluxPosEmbed pos_embed;
  std::shared_ptr<Flux2TimestepGuidanceEmbeddings> time_guidance_embed;
  std::shared_ptr<Flux2Modulation> double_stream_modulation_img;
  std::shared_ptr<Flux2Modulation> double_stream_modulation_txt;
  std::shared_ptr<Flux2Modulation> single_stream_modulation;
  std::shared_ptr<nn::Linear> x_embedder;
  std::shared_ptr<nn::Linear> context_embedder;
  std::shared_ptr<nn::ModuleList<Flux2TransformerBlock>> transformer_blocks;
  std::shared_ptr<nn::ModuleList<Flux2SingleTransformerBlock>> single_transformer_blocks;
  // norm_out, proj_out: JointTransformer2DModel's members, registered here.
};

/// The FLUX.2 pipelines' image position ids (_prepare_latent_ids): [B, h * w, 4] int64, token
/// i * w + j = (t, i, j, 0): t = 0 for the noise, 10 + 10 k for reference image k
/// (_prepare_image_ids).
at::Tensor flux2_image_ids(int64_t batch, int64_t h, int64_t w, int64_t t = 0);

/// The FLUX.2 pipelines' text position ids (_prepare_text_ids): [B, L, 4] int64, token l =
/// (0, 0, 0, l).
at::Tensor flux2_text_ids(int64_t batch, int64_t length);

}  // namespace shardit::models
