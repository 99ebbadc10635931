#pragma once
// diffusers' QwenImagePipeline (pipeline_qwenimage.py): true classifier-free guidance with a
// negative prompt and the norm-preserving rescale of the combined prediction; its denoising loop
// also runs the edit pipelines' (reference tokens after the noise tokens, their grids in
// img_shapes).
#include <string>
#include <vector>

#include "shardit/models/qwen_image/transformer_qwenimage.h"
#include "shardit/pipelines/pipeline.h"
#include "shardit/pipelines/prompt_encoders.h"

namespace shardit::pipelines {

/// Text-to-image with QwenImageTransformer2DModel and AutoencoderKLQwenImage. Prompt embeddings:
/// Qwen2.5-VL's `prompt_embeds` [P, L, joint_attention_dim] with `prompt_embeds_mask` [P, L]
/// (absent: all valid); the negative prompt's likewise, with its own L. True CFG runs when
/// true_cfg_scale > 1 and a negative prompt is given. Defaults as diffusers: 50 steps,
/// true_cfg_scale 4.0, 1024x1024.
class QwenImagePipeline : public DiffusionPipeline {
 public:
  QwenImagePipeline(io::ModelFolder folder, const PipelineLoadOptions& options);
  /// Qwen2.5-VL on the templated prompt, the template's prefix dropped, with the mask.
  static PromptEncoderRecipe prompt_encoder_recipe();
  /// Its schedule's name for `shardit schedule --family` (calculate_shift).
  static constexpr const char* kScheduleFamily = "qwenimage";
  std::string class_name() const override { return "QwenImagePipeline"; }
  bool runs_cfg(const GenerateRequest& request) const override;
  std::string cfg_condition() const override;
  int64_t joint_attention_dim() const override;
  std::vector<int64_t> latents_shape(int64_t batch, int64_t h, int64_t w) const override;
  std::string latents_layout() const override;

  models::QwenImageTransformer2DModel& qwen_transformer() const;

 protected:
  /// For the pipelines that share its latents, CFG and decode (the edit pipelines).
  QwenImagePipeline(io::ModelFolder folder, const PipelineLoadOptions& options, const std::string& pipeline_class);

  CallDefaults call_defaults() const override;
  at::Tensor prepare_latents(const GenerateRequest& request, int64_t batch, int64_t h, int64_t w) const override;
  GenerateResult generate_prepared(PreparedRequest& call, const GenerateRequest& request) override;
};

}  // namespace shardit::pipelines
