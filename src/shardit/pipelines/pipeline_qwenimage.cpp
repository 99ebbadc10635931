#include "shardit/pipelines/pipeline_qwenimage.h"

#include <fmt/format.h>

#include <algorithm>

#include "shardit/core/notes.h"
#include "shardit/dist/world.h"
#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/tokenizers/prompt_templates.h"

namespace shardit::pipelines {

namespace {

/// QwenImagePipeline.encode_prompt: Qwen2.5-VL on the templated prompt, the template prefix
/// dropped, cut to max_sequence_length, with the mask.
class QwenImagePromptEncoder : public PromptEncoder {
 public:
  QwenImagePromptEncoder(std::unique_ptr<tokenizers::Tokenizer> tokenizer,
                         std::shared_ptr<models::Qwen2_5_VLForConditionalGeneration> encoder)
      : tokenizer_(std::move(tokenizer)), encoder_(std::move(encoder)) {}

  PromptEmbeds encode(const std::vector<std::string>& prompts, int64_t max_sequence_length) override {
    const auto rows = tokenizers::encode_qwenimage_prompts(*tokenizer_, prompts);
    const models::QwenImagePromptEmbeds embeds = models::qwenimage_prompt_embeds(
        *encoder_, token_rows(rows, false).to(encoder_->device()), token_rows(rows, true).to(encoder_->device()));
    const int64_t length = std::min(max_sequence_length, embeds.prompt_embeds.size(1));
    PromptEmbeds out;
    out.prompt_embeds = embeds.prompt_embeds.slice(1, 0, length);
    out.prompt_embeds_mask = embeds.prompt_embeds_mask.slice(1, 0, length);
    return out;
  }

 private:
  std::unique_ptr<tokenizers::Tokenizer> tokenizer_;
  std::shared_ptr<models::Qwen2_5_VLForConditionalGeneration> encoder_;
};

}  // namespace

PromptEncoderRecipe QwenImagePipeline::prompt_encoder_recipe() {
  return {{{"tokenizer", "text_encoder", "Qwen2_5_VLForConditionalGeneration", {}}},
          [](const io::ModelFolder&, auto tokenizer_list, auto encoders) -> std::shared_ptr<PromptEncoder> {
            return std::make_shared<QwenImagePromptEncoder>(
                std::move(tokenizer_list[0]), encoder_as<models::Qwen2_5_VLForConditionalGeneration>(encoders[0]));
          }};
}

QwenImagePipeline::QwenImagePipeline(io::ModelFolder folder, const PipelineLoadOptions& options)
    : QwenImagePipeline(std::move(folder), options, "QwenImagePipeline") {}

QwenImagePipeline::QwenImagePipeline(io::ModelFolder folder, const PipelineLoadOptions& options,
                                     const std::string& pipeline_class)
    : DiffusionPipeline(std::move(folder), options, pipeline_class, "QwenImageTransformer2DModel") {}

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
  return class_name() + " runs true CFG when true_cfg_scale (default 4) > 1 and a negative prompt is given";
}

CallDefaults QwenImagePipeline::call_defaults() const {
  // guidance_scale is for guidance-distilled checkpoints, which Qwen-Image is not: unused.
  return {/*num_inference_steps=*/50, /*guidance_scale=*/1.0, /*true_cfg_scale=*/kDefaultTrueCfgScale};
}

at::Tensor QwenImagePipeline::prepare_latents(const GenerateRequest& request, int64_t batch, int64_t h,
                                              int64_t w) const {
  const models::QwenImageTransformer2DModel& transformer = qwen_transformer();
  // Qwen-Image draws [B, 1, C, H/8, W/8]: the frame axis of size 1 does not change the order.
  return packed_noise_latents(request, batch, h, w).to(transformer.device(), transformer.dtype());  // [B, N, 4C]
}

GenerateResult QwenImagePipeline::generate_prepared(PreparedRequest& call, const GenerateRequest& request) {
  models::QwenImageTransformer2DModel& transformer = qwen_transformer();
  if (call.true_cfg_scale > 1 && !has_negative_prompt(request) && request.notes && dist::World::get().rank() == 0) {
    shardit::note(fmt::format("true_cfg_scale is {} but no negative prompt is given; CFG is not applied",
                              call.true_cfg_scale));
  }
  // A mask of all ones is dropped (the pipeline then passes None).
  const auto drop_full_mask = [](PromptEmbeds& embeds) {
    if (embeds.prompt_embeds_mask && embeds.prompt_embeds_mask->ne(0).all().item<bool>()) {
      embeds.prompt_embeds_mask.reset();
    }
  };
  drop_full_mask(call.cond);
  if (call.uncond) drop_full_mask(*call.uncond);
  // The noise grid, then each reference image's (the edit pipelines' img_shapes), for every sample.
  std::vector<models::QwenImageShape> shapes = {{1, call.h, call.w}};
  if (call.references.defined()) {
    const at::Tensor grids = call.references.ids.to(at::kCPU, at::kLong);  // [K, 3]
    for (int64_t k = 0; k < grids.size(0); ++k) {
      shapes.push_back({grids[k][0].item<int64_t>(), grids[k][1].item<int64_t>(), grids[k][2].item<int64_t>()});
    }
  }
  const std::vector<std::vector<models::QwenImageShape>> img_shapes(static_cast<size_t>(call.batch), shapes);

  const at::Tensor latents = denoise(
      call, request,
      [&](const PromptEmbeds& embeds, const at::Tensor& x, const at::Tensor& timestep) {
        models::QwenImageTransformer2DModelInputs inputs;
        // The reference tokens follow the noise tokens at every step: [B, N + M, C4].
        inputs.hidden_states = call.references.defined() ? at::cat({x, call.references.latents}, 1) : x;
        inputs.encoder_hidden_states = embeds.prompt_embeds;
        inputs.encoder_hidden_states_mask = embeds.prompt_embeds_mask;
        inputs.timestep = timestep;
        inputs.img_shapes = img_shapes;
        const at::Tensor prediction = transformer.forward(inputs);
        // Only the noise tokens' prediction steps the latents.
        return call.references.defined() ? prediction.narrow(1, 0, x.size(1)) : prediction;
      },
      [&](const at::Tensor& noise_pred, const at::Tensor& neg) {
        const at::Tensor comb = neg + call.true_cfg_scale * (noise_pred - neg);
        // Rescaled to the conditional prediction's per-token norm over the channels.
        const at::Tensor cond_norm = at::linalg_vector_norm(noise_pred, 2, {-1}, /*keepdim=*/true);
        const at::Tensor comb_norm = at::linalg_vector_norm(comb, 2, {-1}, /*keepdim=*/true);
        return comb * (cond_norm / comb_norm);
      });

  GenerateResult result = make_result(latents, call, call.true_cfg_scale);
  if (vae_) {
    result.image = decode_image(unpack_latents_2x2(latents, call.h, call.w).unsqueeze(2));  // [B, C, 1, H/8, W/8]
  }
  return result;
}

}  // namespace shardit::pipelines
