#include "shardit/pipelines/pipeline_flux.h"

namespace shardit::pipelines {

FluxPipeline::FluxPipeline(io::ModelFolder folder, const PipelineLoadOptions& options)
    : DiffusionPipeline(std::move(folder), options, "FluxPipeline", "FluxTransformer2DModel") {}

models::FluxTransformer2DModel& FluxPipeline::flux_transformer() const {
  return static_cast<models::FluxTransformer2DModel&>(*transformer_);
}

int64_t FluxPipeline::joint_attention_dim() const { return flux_transformer().config.joint_attention_dim; }

int64_t FluxPipeline::pooled_projection_dim() const { return flux_transformer().config.pooled_projection_dim; }

std::vector<int64_t> FluxPipeline::latents_shape(int64_t batch, int64_t h, int64_t w) const {
  const auto& config = flux_transformer().config;
  return {batch, h * w, config.in_channels};
}

std::string FluxPipeline::latents_layout() const { return "packed [B, (H/16)*(W/16), in_channels]"; }

bool FluxPipeline::runs_cfg(const GenerateRequest& request) const {
  return request.true_cfg_scale.value_or(1.0) > 1 && has_negative_prompt(request);
}

std::string FluxPipeline::cfg_condition() const {
  return "FluxPipeline runs true CFG when true_cfg_scale (default 1) > 1 and a negative prompt is given";
}

CallDefaults FluxPipeline::call_defaults() const {
  return {/*num_inference_steps=*/28, /*guidance_scale=*/3.5, /*true_cfg_scale=*/1.0};
}

at::Tensor FluxPipeline::prepare_latents(const GenerateRequest& request, int64_t batch, int64_t h, int64_t w) const {
  const models::FluxTransformer2DModel& transformer = flux_transformer();
  return packed_noise_latents(request, batch, h, w).to(transformer.device(), transformer.dtype());  // [B, N, 4C]
}

GenerateResult FluxPipeline::generate_prepared(PreparedRequest& call, const GenerateRequest& request) {
  models::FluxTransformer2DModel& transformer = flux_transformer();
  const at::Device device = call.device();

  // img_ids (0, row, col) per token, txt_ids zeros.
  const auto float_options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor img_ids = at::zeros({call.h, call.w, 3}, float_options);
  img_ids.select(2, 1).add_(at::arange(call.h, float_options).unsqueeze(1));
  img_ids.select(2, 2).add_(at::arange(call.w, float_options).unsqueeze(0));
  img_ids = img_ids.reshape({call.h * call.w, 3}).to(device);  // [N, 3]

  // Embedded guidance (FLUX.1 [dev]); [schnell] has no guidance embedder.
  std::optional<at::Tensor> guidance;
  if (transformer.config.guidance_embeds) {
    guidance = at::full({call.batch}, call.guidance_scale, float_options).to(device);
  }

  const at::Tensor latents = denoise(
      call, request,
      [&](const PromptEmbeds& embeds, const at::Tensor& x, const at::Tensor& timestep) {
        models::FluxTransformer2DModelInputs inputs;
        inputs.hidden_states = x;
        inputs.encoder_hidden_states = embeds.prompt_embeds;
        inputs.pooled_projections = *embeds.pooled_prompt_embeds;
        inputs.timestep = timestep;
        inputs.img_ids = img_ids;
        inputs.txt_ids = at::zeros({embeds.prompt_embeds.size(1), 3}, float_options).to(device);
        inputs.guidance = guidance;
        return transformer.forward(inputs);
      },
      [&](const at::Tensor& noise_pred, const at::Tensor& neg) {
        return neg + call.true_cfg_scale * (noise_pred - neg);
      });

  GenerateResult result = make_result(latents, call, call.do_cfg ? call.true_cfg_scale : call.guidance_scale);
  if (vae_) result.image = decode_image(unpack_latents_2x2(latents, call.h, call.w));  // [B, C, H/8, W/8]
  return result;
}

}  // namespace shardit::pipelines
