#include "shardit/pipelines/pipeline_flux.h"

#include <algorithm>
#include <cmath>

#include "shardit/models/clip/modeling_clip.h"
#include "shardit/models/t5/modeling_t5.h"
#include "shardit/pipelines/image_processor.h"

namespace shardit::pipelines {

namespace {

/// FluxPipeline.tokenizer_max_length (CLIPTokenizer.model_max_length).
constexpr int64_t kClipMaxLength = 77;

/// FluxPipeline.encode_prompt: CLIP's pooled output and T5's last hidden state.
class FluxPromptEncoder : public PromptEncoder {
 public:
  FluxPromptEncoder(std::unique_ptr<tokenizers::Tokenizer> clip_tokenizer, std::shared_ptr<models::CLIPTextModel> clip,
                    std::unique_ptr<tokenizers::Tokenizer> t5_tokenizer, std::shared_ptr<models::T5EncoderModel> t5)
      : clip_tokenizer_(std::move(clip_tokenizer)),
        clip_(std::move(clip)),
        t5_tokenizer_(std::move(t5_tokenizer)),
        t5_(std::move(t5)) {}

  PromptEmbeds encode(const std::vector<std::string>& prompts, int64_t max_sequence_length) override {
    const at::Tensor clip_ids =
        token_rows((*clip_tokenizer_)(prompts, kClipMaxLength, tokenizers::Padding::MaxLength), false);
    const at::Tensor t5_ids =
        token_rows((*t5_tokenizer_)(prompts, max_sequence_length, tokenizers::Padding::MaxLength), false);
    PromptEmbeds out;
    out.pooled_prompt_embeds = models::flux_clip_prompt_embeds(*clip_, clip_ids.to(clip_->device()));
    out.prompt_embeds = models::flux_t5_prompt_embeds(*t5_, t5_ids.to(t5_->device()));
    return out;
  }

 private:
  std::unique_ptr<tokenizers::Tokenizer> clip_tokenizer_;
  std::shared_ptr<models::CLIPTextModel> clip_;
  std::unique_ptr<tokenizers::Tokenizer> t5_tokenizer_;
  std::shared_ptr<models::T5EncoderModel> t5_;
};

}  // namespace

PromptEncoderRecipe FluxPipeline::prompt_encoder_recipe() {
  return {{{"tokenizer", "text_encoder", "CLIPTextModel", {}}, {"tokenizer_2", "text_encoder_2", "T5EncoderModel", {}}},
          [](const io::ModelFolder&, auto tokenizer_list, auto encoders) -> std::shared_ptr<PromptEncoder> {
            return std::make_shared<FluxPromptEncoder>(
                std::move(tokenizer_list[0]), encoder_as<models::CLIPTextModel>(encoders[0]), std::move(tokenizer_list[1]),
                encoder_as<models::T5EncoderModel>(encoders[1]));
          }};
}

FluxPipeline::FluxPipeline(io::ModelFolder folder, const PipelineLoadOptions& options)
    : FluxPipeline(std::move(folder), options, "FluxPipeline") {}

FluxPipeline::FluxPipeline(io::ModelFolder folder, const PipelineLoadOptions& options,
                           const std::string& pipeline_class)
    : DiffusionPipeline(std::move(folder), options, pipeline_class, "FluxTransformer2DModel") {}

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
        // Kontext's image tokens follow the noise tokens at every step: [B, N + M, 4C], ids [N + M, 3].
        inputs.hidden_states = call.references.defined() ? at::cat({x, call.references.latents}, 1) : x;
        inputs.encoder_hidden_states = embeds.prompt_embeds;
        inputs.pooled_projections = *embeds.pooled_prompt_embeds;
        inputs.timestep = timestep;
        inputs.img_ids = call.references.defined() ? at::cat({img_ids, call.references.ids}, 0) : img_ids;
        inputs.txt_ids = at::zeros({embeds.prompt_embeds.size(1), 3}, float_options).to(device);
        inputs.guidance = guidance;
        const at::Tensor prediction = transformer.forward(inputs);
        // Only the noise tokens' prediction steps the latents.
        return call.references.defined() ? prediction.narrow(1, 0, x.size(1)) : prediction;
      },
      [&](const at::Tensor& noise_pred, const at::Tensor& neg) {
        return neg + call.true_cfg_scale * (noise_pred - neg);
      });

  GenerateResult result = make_result(latents, call, call.do_cfg ? call.true_cfg_scale : call.guidance_scale);
  if (vae_) result.image = decode_image(unpack_latents_2x2(latents, call.h, call.w));  // [B, C, H/8, W/8]
  return result;
}

FluxKontextPipeline::FluxKontextPipeline(io::ModelFolder folder, const PipelineLoadOptions& options)
    : FluxPipeline(std::move(folder), options, "FluxKontextPipeline") {}

namespace {
/// FluxKontextPipeline's max_area without one given.
constexpr int64_t kDefaultMaxArea = int64_t{1024} * 1024;
}  // namespace

std::pair<int64_t, int64_t> FluxKontextPipeline::requested_size(const GenerateRequest& request) const {
  const auto [height, width] = DiffusionPipeline::requested_size(request);
  const auto area = static_cast<double>(request.max_area.value_or(kDefaultMaxArea));
  const double aspect = static_cast<double>(width) / static_cast<double>(height);
  // Python's round(): half to even, which nearbyint does in the default rounding mode.
  return {static_cast<int64_t>(std::nearbyint(std::sqrt(area / aspect))),
          static_cast<int64_t>(std::nearbyint(std::sqrt(area * aspect)))};
}

void FluxKontextPipeline::check_reference_images(const GenerateRequest& request, int64_t batch) const {
  // Below one latent patch an image holds nothing to edit (and without _auto_resize it would be
  // floored to an empty one).
  const int64_t multiple = vae_scale_factor_ * 2;
  for (size_t i = 0; i < request.image.size(); ++i) {
    const at::Tensor& image = request.image[i];
    TORCH_CHECK(image.size(0) >= multiple && image.size(1) >= multiple, class_name(), ": reference image ", i,
                " (--image) is ", image.size(1), "x", image.size(0), "; both sides must be at least ", multiple,
                " pixels to edit from");
  }
  // The size every image is encoded at (the first's): without _auto_resize the image's own, which
  // must stay within the larger of the output's area and the preferred resolutions' (what
  // _auto_resize gives), checked before anything is resized or encoded.
  const at::Tensor& first = request.image.front();
  const auto [encoded_height, encoded_width] =
      kontext_image_size(first.size(0), first.size(1), request.auto_resize, vae_scale_factor_, multiple);
  int64_t max_encoded_area = request.max_area.value_or(kDefaultMaxArea);
  for (const auto& [w, h] : preferred_kontext_resolutions()) max_encoded_area = std::max(max_encoded_area, w * h);
  TORCH_CHECK(encoded_height * encoded_width <= max_encoded_area, class_name(), ": reference image 0 (--image) is ",
              first.size(1), "x", first.size(0), " and would reach the VAE encoder as ", encoded_width, "x",
              encoded_height, " (", encoded_width * encoded_height, " pixels) without auto-resize; at most ",
              max_encoded_area, " pixels (the output's area, --max-area, or the preferred Kontext resolutions') are "
              "encoded: drop --no-auto-resize, or give a smaller image");
  const auto images = static_cast<int64_t>(request.image.size());
  TORCH_CHECK(batch % images == 0, class_name(), ": cannot duplicate `image` of batch size ", images, " to ", batch,
              " text prompts (prompts x --num-images): give one image, or one per image of the call");
}

ReferenceTokens FluxKontextPipeline::reference_tokens(const GenerateRequest& request, int64_t batch) const {
  if (request.image.empty()) return {};
  // Every image takes the size the first one chooses (VaeImageProcessor.resize of the batch).
  const at::Tensor& first = request.image.front();
  const auto [image_height, image_width] =
      kontext_image_size(first.size(0), first.size(1), request.auto_resize, vae_scale_factor_, vae_scale_factor_ * 2);
  std::vector<at::Tensor> tokens;
  for (const at::Tensor& pixels : request.image) {
    const at::Tensor image = kontext_condition_image(pixels, image_height, image_width);  // [1, 3, H, W]
    const at::Tensor latents = encode_image_latents(image);  // [1, C, H/8, W/8], shifted and scaled
    tokens.push_back(pack_latents_2x2(latents));            // [1, M, 4C]
  }
  const int64_t h = image_height / (vae_scale_factor_ * 2);
  const int64_t w = image_width / (vae_scale_factor_ * 2);
  // (1, row, col): the noise's ids with the first coordinate 1.
  const auto float_options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor ids = at::ones({h, w, 3}, float_options);
  ids.select(2, 1).copy_(at::arange(h, float_options).unsqueeze(1).expand({h, w}));
  ids.select(2, 2).copy_(at::arange(w, float_options).unsqueeze(0).expand({h, w}));
  ReferenceTokens references;
  const auto images = static_cast<int64_t>(request.image.size());
  // torch.cat([latents] * (batch / images)): the images in order, repeated.
  references.latents = at::cat(tokens, 0).repeat({batch / images, 1, 1});  // [B, M, 4C]
  references.ids = ids.reshape({h * w, 3});                                 // [M, 3]
  return references;
}

}  // namespace shardit::pipelines
