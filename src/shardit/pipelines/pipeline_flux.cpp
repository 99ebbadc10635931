#include "shardit/pipelines/pipeline_flux.h"

#include <fmt/format.h>

#include "shardit/dist/world.h"

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

GenerateResult FluxPipeline::generate(const GenerateRequest& request) {
  TORCH_CHECK(loaded_, class_name(), ": load() the weights before generate()");
  check(request);
  models::FluxTransformer2DModel& transformer = flux_transformer();
  const auto& config = transformer.config;
  const auto [height, width] = resolve_size(request);
  const int64_t steps = request.num_inference_steps.value_or(28);
  const double guidance_scale = request.guidance_scale.value_or(3.5);
  const double true_cfg_scale = request.true_cfg_scale.value_or(1.0);
  const int64_t n = request.num_images_per_prompt;

  const PromptEmbeds positive = positive_embeds(request);
  const int64_t num_prompts = positive.num_prompts();
  const auto negative = negative_embeds(request, num_prompts);
  const bool do_true_cfg = runs_cfg(request);
  TORCH_INTERNAL_ASSERT(!do_true_cfg || negative.has_value());

  // Latent token grid: the VAE's latent is (H/8, W/8), packed 2x2 into (H/16, W/16) tokens.
  const int64_t h = height / (vae_scale_factor_ * 2);
  const int64_t w = width / (vae_scale_factor_ * 2);
  const int64_t batch = num_prompts * n;
  const int64_t channels = config.in_channels / 4;
  // Noise is drawn unpacked, [B, C, H/8, W/8], and packed to [B, N, 4C] as the pipeline does.
  const at::Tensor latents_in = request.latents
                                    ? initial_latents(request, batch, h, w)
                                    : pack_latents_2x2(seeded_noise({batch, channels, 2 * h, 2 * w}, request.seed));
  const at::Device device = transformer.device();
  const at::ScalarType dtype = transformer.dtype();
  at::Tensor latents = latents_in.to(device, dtype);

  const PromptEmbeds cond = repeat_prompt_embeds(positive, n, dtype, device);
  std::optional<PromptEmbeds> uncond;
  if (do_true_cfg) uncond = repeat_prompt_embeds(*negative, n, dtype, device);

  // img_ids (0, row, col) per token, txt_ids zeros.
  const auto float_options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor img_ids = at::zeros({h, w, 3}, float_options);
  img_ids.select(2, 1).add_(at::arange(h, float_options).unsqueeze(1));
  img_ids.select(2, 2).add_(at::arange(w, float_options).unsqueeze(0));
  img_ids = img_ids.reshape({h * w, 3}).to(device);  // [N, 3]

  auto scheduler = make_scheduler(steps, calculate_shift(h * w));

  std::optional<at::Tensor> guidance;
  if (config.guidance_embeds) guidance = at::full({batch}, guidance_scale, float_options).to(device);

  const auto run = [&](const PromptEmbeds& embeds, const at::Tensor& x, const at::Tensor& timestep) {
    models::FluxTransformer2DModelInputs inputs;
    inputs.hidden_states = x;
    inputs.encoder_hidden_states = embeds.prompt_embeds;
    inputs.pooled_projections = *embeds.pooled_prompt_embeds;
    inputs.timestep = timestep;
    inputs.img_ids = img_ids;
    inputs.txt_ids = at::zeros({embeds.prompt_embeds.size(1), 3}, float_options).to(device);
    inputs.guidance = guidance;
    return transformer.forward(inputs);
  };
  latents = denoise(
      scheduler, latents,
      [&](const at::Tensor& x, const at::Tensor& timestep) {
        return guided(
            do_true_cfg, [&](bool conditional) { return run(conditional ? cond : *uncond, x, timestep); },
            [&](const at::Tensor& noise_pred, const at::Tensor& neg) {
              return neg + true_cfg_scale * (noise_pred - neg);
            });
      },
      request);

  GenerateResult result =
      make_result(latents, height, width, steps, do_true_cfg ? true_cfg_scale : guidance_scale, do_true_cfg);
  if (vae_) result.image = decode_image(unpack_latents_2x2(latents, h, w));  // [B, C, H/8, W/8]
  return result;
}

}  // namespace shardit::pipelines
