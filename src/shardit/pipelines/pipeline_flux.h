#pragma once
// diffusers' FluxPipeline (pipeline_flux.py): FLUX.1 [dev] with embedded guidance, FLUX.1
// [schnell] (no guidance embedder), and true CFG with a negative prompt when true_cfg_scale > 1.
#include <memory>
#include <string>
#include <vector>

#include "shardit/models/flux/transformer_flux.h"
#include "shardit/pipelines/pipeline.h"
#include "shardit/pipelines/prompt_encoders.h"

namespace shardit::pipelines {

/// Text-to-image with FluxTransformer2DModel and AutoencoderKL. Prompt embeddings: T5's
/// `prompt_embeds` [P, L, joint_attention_dim] and CLIP's `pooled_prompt_embeds`
/// [P, pooled_projection_dim]. Defaults as diffusers: 28 steps, guidance 3.5, 1024x1024.
class FluxPipeline : public DiffusionPipeline {
 public:
  FluxPipeline(io::ModelFolder folder, const PipelineLoadOptions& options);
  /// FluxPipeline.encode_prompt: CLIP's pooled output (tokenizer, text_encoder) and T5's last
  /// hidden state (tokenizer_2, text_encoder_2).
  static PromptEncoderRecipe prompt_encoder_recipe();
  /// Its schedule's name for `shardit schedule --family` (calculate_shift).
  static constexpr const char* kScheduleFamily = "flux1";
  std::string class_name() const override { return "FluxPipeline"; }
  bool runs_cfg(const GenerateRequest& request) const override;
  std::string cfg_condition() const override;
  int64_t joint_attention_dim() const override;
  int64_t pooled_projection_dim() const override;
  std::vector<int64_t> latents_shape(int64_t batch, int64_t h, int64_t w) const override;
  std::string latents_layout() const override;

  models::FluxTransformer2DModel& flux_transformer() const;

 protected:
  /// For FluxKontextPipeline, which shares the transformer, latents and loop.
  FluxPipeline(io::ModelFolder folder, const PipelineLoadOptions& options, const std::string& pipeline_class);

  CallDefaults call_defaults() const override;
  at::Tensor prepare_latents(const GenerateRequest& request, int64_t batch, int64_t h, int64_t w) const override;
  /// The loop with the call's reference tokens (if any) after the noise tokens at every step.
  GenerateResult generate_prepared(PreparedRequest& call, const GenerateRequest& request) override;
};

/// diffusers' FluxKontextPipeline (pipeline_flux_kontext.py): FLUX.1 Kontext, image editing with
/// FLUX.1's transformer. The output size is rescaled to max_area pixels (default 1024²) at the
/// requested aspect; the input image is resized to the preferred Kontext resolution nearest in
/// aspect (_auto_resize) or kept at its own size, encoded, shifted and scaled, packed like the
/// noise and appended after it with ids (1, row, col). Also builds on FLUX.1 folders whose
/// model_index.json names FluxPipeline (`--pipeline FluxKontextPipeline`).
class FluxKontextPipeline : public FluxPipeline {
 public:
  FluxKontextPipeline(io::ModelFolder folder, const PipelineLoadOptions& options);
  std::string class_name() const override { return "FluxKontextPipeline"; }
  /// One image for the whole batch, or one per row of it (diffusers' batch of images).
  int64_t max_reference_images() const override { return kMaxReferenceImages; }
  bool takes_max_area() const override { return true; }
  bool max_area_is_output_area() const override { return true; }
  ReferenceTokens reference_tokens(const GenerateRequest& request, int64_t batch) const override;

 protected:
  /// height x width (default 1024²) rescaled to max_area pixels at the same aspect, rounded half to even.
  std::pair<int64_t, int64_t> requested_size(const GenerateRequest& request) const override;
  /// The images' count must divide the batch (diffusers repeats them to fill it).
  void check_reference_images(const GenerateRequest& request, int64_t batch) const override;
};

}  // namespace shardit::pipelines
