#pragma once
// diffusers' FluxPipeline (pipeline_flux.py): FLUX.1 [dev] with embedded guidance, FLUX.1
// [schnell] (no guidance embedder), and true CFG with a negative prompt when true_cfg_scale > 1.
#include <memory>
#include <string>
#include <vector>

#include "shardit/models/flux/transformer_flux.h"
#include "shardit/pipelines/pipeline.h"

namespace shardit::pipelines {

/// Text-to-image with FluxTransformer2DModel and AutoencoderKL. Prompt embeddings: T5's
/// `prompt_embeds` [P, L, joint_attention_dim] and CLIP's `pooled_prompt_embeds`
/// [P, pooled_projection_dim]. Defaults as diffusers: 28 steps, guidance 3.5, 1024x1024.
class FluxPipeline : public DiffusionPipeline {
 public:
  FluxPipeline(io::ModelFolder folder, const PipelineLoadOptions& options);
  std::string class_name() const override { return "FluxPipeline"; }
  bool runs_cfg(const GenerateRequest& request) const override;
  std::string cfg_condition() const override;
  int64_t joint_attention_dim() const override;
  int64_t pooled_projection_dim() const override;
  std::vector<int64_t> latents_shape(int64_t batch, int64_t h, int64_t w) const override;
  std::string latents_layout() const override;

  models::FluxTransformer2DModel& flux_transformer() const;

 protected:
  CallDefaults call_defaults() const override;
  at::Tensor prepare_latents(const GenerateRequest& request, int64_t batch, int64_t h, int64_t w) const override;
  GenerateResult generate_prepared(PreparedRequest& call, const GenerateRequest& request) override;
};

}  // namespace shardit::pipelines
