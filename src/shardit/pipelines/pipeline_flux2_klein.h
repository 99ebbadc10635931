#pragma once
// diffusers' Flux2KleinPipeline (pipeline_flux2_klein.py): FLUX.2 [klein] with classifier-free
// guidance against the empty negative prompt unless the checkpoint is distilled; and
// Flux2Pipeline (pipeline_flux2.py), FLUX.2 [dev], with embedded guidance.
#include <optional>
#include <string>
#include <vector>

#include "shardit/models/flux2/transformer_flux2.h"
#include "shardit/pipelines/pipeline.h"
#include "shardit/pipelines/prompt_encoders.h"

namespace shardit::pipelines {

/// Text-to-image with Flux2Transformer2DModel and AutoencoderKLFlux2. Prompt embeddings: the
/// Qwen3 hidden-state stack `prompt_embeds` [P, L, joint_attention_dim]; with CFG (guidance_scale
/// > 1 and model_index.json's is_distilled false) also `negative_prompt_embeds` (the prompt "").
/// Defaults as diffusers: 50 steps, guidance 4.0, 1024x1024.
class Flux2KleinPipeline : public DiffusionPipeline {
 public:
  Flux2KleinPipeline(io::ModelFolder folder, const PipelineLoadOptions& options);
  /// Qwen3 on the chat-templated prompt, hidden states 9/18/27 stacked.
  static PromptEncoderRecipe prompt_encoder_recipe();
  /// Its schedule's name for `shardit schedule --family` (compute_empirical_mu, scheduler_mu).
  static constexpr const char* kScheduleFamily = "flux2";
  std::string class_name() const override { return "Flux2KleinPipeline"; }
  bool runs_cfg(const GenerateRequest& request) const override;
  std::string cfg_condition() const override;
  bool supports_cfg() const override { return !is_distilled_; }
  int64_t joint_attention_dim() const override;
  std::vector<int64_t> latents_shape(int64_t batch, int64_t h, int64_t w) const override;
  std::string latents_layout() const override;

  /// Up to kMaxReferenceImages reference images (diffusers' `image=[...]`).
  int64_t max_reference_images() const override { return kMaxReferenceImages; }
  /// Each image prepared (flux2_condition_image), encoded, patchified and batch-norm-normalised,
  /// packed to its own tokens with ids (10 + 10 k, row, col, 0), all concatenated in order and
  /// repeated for every image of the batch.
  ReferenceTokens reference_tokens(const GenerateRequest& request, int64_t batch) const override;

  models::Flux2Transformer2DModel& flux2_transformer() const;
  /// model_index.json's is_distilled (no CFG when true).
  bool is_distilled() const { return is_distilled_; }

 protected:
  /// For pipelines that share [klein]'s latents, ids, scheduler and decode (Flux2Pipeline).
  Flux2KleinPipeline(io::ModelFolder folder, const PipelineLoadOptions& options, const std::string& pipeline_class);

  CallDefaults call_defaults() const override;
  std::optional<PromptEmbeds> call_negative_embeds(const GenerateRequest& request, const PreparedRequest& call,
                                                   int64_t num_prompts) const override;
  at::Tensor prepare_latents(const GenerateRequest& request, int64_t batch, int64_t h, int64_t w) const override;
  double scheduler_mu(int64_t image_seq_len, int64_t steps) const override;
  /// The request's size, else the first reference image's prepared size, else 1024x1024.
  std::pair<int64_t, int64_t> requested_size(const GenerateRequest& request) const override;
  /// Flux2ImageProcessor.check_image_input of every image.
  void check_reference_images(const GenerateRequest& request, int64_t batch) const override;
  GenerateResult generate_prepared(PreparedRequest& call, const GenerateRequest& request) override;

 private:
  bool is_distilled_ = false;
};

/// diffusers' Flux2Pipeline (pipeline_flux2.py), FLUX.2 [dev]: the Mistral-3 prompt embeddings
/// (system message and chat template, hidden states 10/20/30, padding rows included), the
/// guidance scale embedded in the transformer (guidance_embeds), one transformer call per step:
/// no CFG and no negative prompt. Latents, position ids, the empirical mu and the decode are
/// [klein]'s. Defaults as diffusers: 50 steps, guidance 4.0, max_sequence_length 512.
class Flux2Pipeline : public Flux2KleinPipeline {
 public:
  Flux2Pipeline(io::ModelFolder folder, const PipelineLoadOptions& options);
  /// Mistral-3 on the system message and chat template (left-padded to max_sequence_length),
  /// hidden states 10/20/30 stacked; only the layers up to the last of them are built and loaded.
  static PromptEncoderRecipe prompt_encoder_recipe();
  std::string class_name() const override { return "Flux2Pipeline"; }
  bool runs_cfg(const GenerateRequest& request) const override;
  std::string cfg_condition() const override;
  bool supports_cfg() const override { return false; }
  bool takes_negative_prompt() const override { return false; }

 protected:
  CallDefaults call_defaults() const override;
  std::optional<PromptEmbeds> call_negative_embeds(const GenerateRequest& request, const PreparedRequest& call,
                                                   int64_t num_prompts) const override;
};

}  // namespace shardit::pipelines
