#pragma once
// Qwen-Image transformer (diffusers' models/transformers/transformer_qwenimage.py): double-stream
// blocks only, each with its own image/text modulation (SiLU + Linear(D -> 6D)), LayerNorms,
// joint attention over [text; image] with a key mask that hides padded text tokens, and
// GELU-tanh feed-forwards. RoPE has three axes (frame, height, width) with centred image positions
// and text positions placed after the image's. With `zero_cond_t` (Qwen-Image-Edit-2511) the image
// tokens after the first grid (the reference images') are modulated with the embedding of
// timestep 0 instead of the step's. Members are named as the checkpoint keys.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <array>
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

/// config.json of QwenImageTransformer2DModel (same keys, same defaults as diffusers).
struct QwenImageTransformer2DModelConfig {
  int64_t patch_size = 2;
  int64_t in_channels = 64;
  std::optional<int64_t> out_channels = 16;  ///< null: in_channels
  int64_t num_layers = 60;
  int64_t attention_head_dim = 128;
  int64_t num_attention_heads = 24;
  int64_t joint_attention_dim = 3584;
  std::vector<int64_t> axes_dims_rope = {16, 56, 56};
  /// Qwen-Image-Edit-2511: the tokens of img_shapes' second and later grids (reference images)
  /// take the modulation of timestep 0; adds no parameters.
  bool zero_cond_t = false;

  /// Parses and validates a config.json object; `source` names the file in errors. The variants
  /// this engine does not implement (guidance_embeds, use_additional_t_cond, use_layer3d_rope set
  /// to true) are rejected.
  static QwenImageTransformer2DModelConfig from_json(const nlohmann::json& json, const std::string& source);

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  int64_t resolved_out_channels() const { return out_channels.value_or(in_channels); }
};

/// One (frame, height, width) latent-token grid.
using QwenImageShape = std::array<int64_t, 3>;

/// diffusers' QwenEmbedRope (scale_rope=True) in the real form: fp32 frequencies
/// 1 / theta^(2j/d) per axis, fp32 angles position * frequency. Image tokens of grid `idx` of the
/// list get frame positions idx + f and centred height/width positions
/// [-(n - n//2) .. -1, 0 .. n//2 - 1]; text token i gets max(h//2, w//2) + i on all three axes.
class QwenEmbedRope {
 public:
  QwenEmbedRope(double theta, std::vector<int64_t> axes_dim);

  struct Tables {
    at::Tensor img_angles;  ///< [N, head_dim / 2] fp32
    at::Tensor txt_angles;  ///< [L, head_dim / 2] fp32
  };
  /// `shapes`: the grids of one sample, in token order; `text_len`: L.
  Tables forward(const std::vector<QwenImageShape>& shapes, int64_t text_len, at::Device device) const;

 private:
  /// fp32 angles [S, head_dim / 2] for per-axis positions (each [S], fp32).
  at::Tensor angles(const std::vector<at::Tensor>& axis_positions) const;

  double theta_;
  std::vector<int64_t> axes_dim_;
};

/// QwenTimestepProjEmbeddings: timestep_embedder(Timesteps(256, cos first, scale 1000)(t)).
class QwenTimestepProjEmbeddings : public nn::Module {
 public:
  explicit QwenTimestepProjEmbeddings(int64_t embedding_dim);
  std::string type_name() const override { return "QwenTimestepProjEmbeddings"; }
  /// timestep [B] fp32 as the pipeline passes it (t/1000) -> temb [B, D] in `dtype`.
  at::Tensor forward(const at::Tensor& timestep, at::ScalarType dtype);

  nn::Timesteps time_proj;
  std::shared_ptr<nn::TimestepEmbedding> timestep_embedder;
};

/// torch.nn.Sequential(SiLU, Linear(D -> 6D)): the block modulation; the linear is child "1".
class QwenModulation : public nn::Module {
 public:
  explicit QwenModulation(int64_t dim);
  std::string type_name() const override { return "Sequential"; }
  /// temb [B, D] -> [B, 6D] = [shift, scale, gate] (attention), [shift, scale, gate] (MLP).
  at::Tensor forward(const at::Tensor& temb);

  std::shared_ptr<nn::Linear> linear;  ///< registered as "1"
};

/// diffusers' Attention with QwenDoubleStreamAttnProcessor2_0: per-head RMS-normed q/k for both
/// streams, RoPE per stream, joint attention over [text; image] with an optional key mask. The
/// local head count comes from the projected width, so colwise-sharded projections just work.
class QwenDoubleStreamAttention : public nn::Module {
 public:
  QwenDoubleStreamAttention(int64_t dim, int64_t heads, int64_t dim_head, double eps);
  std::string type_name() const override { return "Attention"; }

  /// hidden_states [B, N, D], encoder_hidden_states [B, L, D]; img_rope [N, hd], txt_rope [L, hd];
  /// key_mask (optional) bool [B, L + N], true = attend. Returns {image [B, N, D], text [B, L, D]}.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                            const nn::RotaryEmbedding& img_rope, const nn::RotaryEmbedding& txt_rope,
                                            const std::optional<at::Tensor>& key_mask);

  std::shared_ptr<nn::Linear> to_q, to_k, to_v;
  std::shared_ptr<nn::RMSNorm> norm_q, norm_k;
  std::shared_ptr<nn::ModuleList<nn::Linear>> to_out;  ///< to_out.0 (to_out.1 is a dropout)
  std::shared_ptr<nn::Linear> add_q_proj, add_k_proj, add_v_proj;
  std::shared_ptr<nn::RMSNorm> norm_added_q, norm_added_k;
  std::shared_ptr<nn::Linear> to_add_out;

 private:
  int64_t head_dim_;
};

/// QwenImageTransformerBlock: image and text streams with their own modulation, norms and FFs,
/// one joint attention.
class QwenImageTransformerBlock : public nn::Module {
 public:
  QwenImageTransformerBlock(int64_t dim, int64_t num_attention_heads, int64_t attention_head_dim, double eps = 1e-6);
  std::string type_name() const override { return "QwenImageTransformerBlock"; }

  /// Returns {encoder_hidden_states, hidden_states}, as the reference. `reference_tokens`
  /// (zero_cond_t): bool [B, N], true on the reference images' tokens; `temb` is then [2B, D], the
  /// step's embeddings then timestep 0's, and the text stream takes the first B rows.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                            const at::Tensor& temb, const nn::RotaryEmbedding& img_rope,
                                            const nn::RotaryEmbedding& txt_rope,
                                            const std::optional<at::Tensor>& key_mask,
                                            const std::optional<at::Tensor>& reference_tokens);

  std::shared_ptr<QwenModulation> img_mod, txt_mod;
  // img_norm1/2, txt_norm1/2: LayerNorm without affine parameters.
  std::shared_ptr<QwenDoubleStreamAttention> attn;
  std::shared_ptr<nn::FeedForward> img_mlp, txt_mlp;

 private:
  double eps_;
};

/// The arguments of QwenImageTransformer2DModel.forward, as the pipeline passes them.
struct QwenImageTransformer2DModelInputs {
  at::Tensor hidden_states;          ///< [B, N, in_channels] packed latents
  at::Tensor encoder_hidden_states;  ///< [B, L, joint_attention_dim]
  std::optional<at::Tensor> encoder_hidden_states_mask;  ///< [B, L] (1 / true = valid); none: all valid
  at::Tensor timestep;               ///< [B] (or a scalar), t/1000; scaled by 1000 inside the projection
  /// Per sample, the list of (frame, height, width) grids of its image tokens (diffusers'
  /// img_shapes). All samples must agree; their token counts must add up to N.
  std::vector<std::vector<QwenImageShape>> img_shapes;

  /// Read from a case file, by argument name (encoder_hidden_states_mask optional); img_shapes from
  /// an `img_shapes` int64 tensor ([B, K, 3] or [B, 3]) in the file if there is one, otherwise from
  /// `non_tensor_kwargs.img_shapes` of the inputs.json next to the file.
  static QwenImageTransformer2DModelInputs from_file(const io::SafetensorsFile& file);
};

/// The skeleton of its forward, norm_out / proj_out and traits() come from
/// JointTransformer2DModel.
class QwenImageTransformer2DModel : public JointTransformer2DModel {
 public:
  explicit QwenImageTransformer2DModel(const QwenImageTransformer2DModelConfig& config);
  std::string type_name() const override { return "QwenImageTransformer2DModel"; }

  const parallel::TpPlan& tp_plan() const override;
  /// How its single files name its tensors (a registry row carries them; models/single_file.h).
  static const std::vector<SingleFileLayout>& single_file_layouts();

  std::vector<std::string> high_precision_modules() const override;
  /// diffusers' `_tp_plan` for this class, entry for entry (modulation replicated).
  const parallel::TpPlan* reference_tp_plan() const override;
  /// Image and text tokens, their rotary rows and the reference-token mask split along the
  /// sequence, the sample gathered.
  const parallel::CpPlan* cp_plan() const override;
  StepModel step_model(const StepShape& shape) const override;
  at::Tensor forward_from_file(const io::SafetensorsFile& inputs) override;
  const LoraKeyConventions& lora_conventions() const override;
  BlockCounts block_counts() const override { return {static_cast<int64_t>(transformer_blocks->size()), 0}; }

  /// One denoiser evaluation; returns the sample [B, N, patch_size^2 * out_channels] in the
  /// model's dtype. Intermediates go to Module::emit (img_in, txt_norm, txt_in, temb.*, rope.*,
  /// block.*, norm_out.*, and the blocks' own).
  at::Tensor forward(const QwenImageTransformer2DModelInputs& inputs);

  const QwenImageTransformer2DModelConfig config;

  QwenEmbedRope pos_embed;
  std::shared_ptr<QwenTimestepProjEmbeddings> time_text_embed;
  std::shared_ptr<nn::RMSNorm> txt_norm;
  std::shared_ptr<nn::Linear> img_in;
  std::shared_ptr<nn::Linear> txt_in;
  std::shared_ptr<nn::ModuleList<QwenImageTransformerBlock>> transformer_blocks;
  // norm_out, proj_out: JointTransformer2DModel's members, registered here.
};

}  // namespace shardit::models
