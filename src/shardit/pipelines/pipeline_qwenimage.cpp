#include "shardit/pipelines/pipeline_qwenimage.h"

#include <fmt/format.h>

#include "shardit/dist/world.h"

namespace shardit::pipelines {

QwenImagePipeline::QwenImagePipeline(io::ModelFolder folder, const PipelineLoadOptions& options)
    : DiffusionPipeline(std::move(folder), options, "QwenImagePipeline", "QwenImageTransformer2DModel") {}

models::QwenImageTransformer2DModel& QwenImagePipeline::qwen_transformer() const {
  return static_cast<models::QwenImageTransformer2DModel&>(*transformer_);
}

int64_t QwenImagePipeline::joint_attention_dim() const { return qwen_transformer().config.joint_attention_dim; }

std::vector<int64_t> QwenImagePipeline::latents_shape(int64_t batch, int64_t h, int64_t w) const {
  const auto& config = qwen_transformer().config;
  return {batch, h * w, config.in_channels};
}

std::string QwenImagePipeline::latents_layout() const { return "packed [B, (H/16)*(W/16), in_channels]"; }

namespace {
constexpr double kDefaultTrueCfgScale = 4.0;
}

bool QwenImagePipeline::runs_cfg(const GenerateRequest& request) const {
  return request.true_cfg_scale.value_or(kDefaultTrueCfgScale) > 1 && has_negative_prompt(request);
}

std::string QwenImagePipeline::cfg_condition() const {
  return "QwenImagePipeline runs true CFG when true_cfg_scale (default 4) > 1 and a negative prompt is given";
}

GenerateResult QwenImagePipeline::generate(const GenerateRequest& request) {
  TORCH_CHECK(loaded_, class_name(), ": load() the weights before generate()");
  check(request);
  models::QwenImageTransformer2DModel& transformer = qwen_transformer();
  const auto& config = transformer.config;
  const auto [height, width] = resolve_size(request);
  const int64_t steps = request.num_inference_steps.value_or(50);
  const double true_cfg_scale = request.true_cfg_scale.value_or(kDefaultTrueCfgScale);
  const int64_t n = request.num_images_per_prompt;

  const PromptEmbeds positive = positive_embeds(request);
  const int64_t num_prompts = positive.num_prompts();
  const auto negative = negative_embeds(request, num_prompts);
  const bool do_true_cfg = runs_cfg(request);
  TORCH_INTERNAL_ASSERT(!do_true_cfg || negative.has_value());
  if (true_cfg_scale > 1 && !negative && request.progress && dist::World::get().rank() == 0) {
    fmt::print(stderr, "note: true_cfg_scale is {} but no negative prompt is given; CFG is not applied\n",
               true_cfg_scale);
  }

  const int64_t h = height / (vae_scale_factor_ * 2);
  const int64_t w = width / (vae_scale_factor_ * 2);
  const int64_t batch = num_prompts * n;
  const int64_t channels = config.in_channels / 4;
  // Noise is drawn unpacked, [B, C, H/8, W/8], and packed to [B, N, 4C] as the pipeline does.
  // (Qwen-Image draws [B, 1, C, H/8, W/8]: the frame axis of size 1 does not change the order.)
  const at::Tensor latents_in = request.latents
                                    ? initial_latents(request, batch, h, w)
                                    : pack_latents_2x2(seeded_noise({batch, channels, 2 * h, 2 * w}, request.seed));
  const at::Device device = transformer.device();
  const at::ScalarType dtype = transformer.dtype();
  at::Tensor latents = latents_in.to(device, dtype);

  // A mask of all ones is dropped (the pipeline then passes None).
  const auto prepare = [&](const PromptEmbeds& embeds) {
    PromptEmbeds repeated = repeat_prompt_embeds(embeds, n, dtype, device);
    if (repeated.prompt_embeds_mask && repeated.prompt_embeds_mask->ne(0).all().item<bool>()) {
      repeated.prompt_embeds_mask.reset();
    }
    return repeated;
  };
  const PromptEmbeds cond = prepare(positive);
  std::optional<PromptEmbeds> uncond;
  if (do_true_cfg) uncond = prepare(*negative);

  auto scheduler = make_scheduler(steps, calculate_shift(h * w));
  const std::vector<std::vector<models::QwenImageShape>> img_shapes(static_cast<size_t>(batch), {{1, h, w}});

  const auto run = [&](const PromptEmbeds& embeds, const at::Tensor& x, const at::Tensor& timestep) {
    models::QwenImageTransformer2DModelInputs inputs;
    inputs.hidden_states = x;
    inputs.encoder_hidden_states = embeds.prompt_embeds;
    inputs.encoder_hidden_states_mask = embeds.prompt_embeds_mask;
    inputs.timestep = timestep;
    inputs.img_shapes = img_shapes;
    return transformer.forward(inputs);
  };
  latents = denoise(
      scheduler, latents,
      [&](const at::Tensor& x, const at::Tensor& timestep) {
        return guided(
            do_true_cfg, [&](bool conditional) { return run(conditional ? cond : *uncond, x, timestep); },
            [&](const at::Tensor& noise_pred, const at::Tensor& neg) {
              const at::Tensor comb = neg + true_cfg_scale * (noise_pred - neg);
              // Rescaled to the conditional prediction's per-token norm over the channels.
              const at::Tensor cond_norm = at::linalg_vector_norm(noise_pred, 2, {-1}, /*keepdim=*/true);
              const at::Tensor comb_norm = at::linalg_vector_norm(comb, 2, {-1}, /*keepdim=*/true);
              return comb * (cond_norm / comb_norm);
            });
      },
      request);

  GenerateResult result = make_result(latents, height, width, steps, true_cfg_scale, do_true_cfg);
  if (vae_) result.image = decode_image(unpack_latents_2x2(latents, h, w).unsqueeze(2));  // [B, C, 1, H/8, W/8]
  return result;
}

}  // namespace shardit::pipelines
