#include "shardit/pipelines/pipeline_flux2_klein.h"

#include <fmt/format.h>

#include "shardit/models/mistral/modeling_mistral3.h"
#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/pipelines/image_processor.h"
#include "shardit/tokenizers/prompt_templates.h"

namespace shardit::pipelines {

namespace {

constexpr double kDefaultGuidanceScale = 4.0;

/// The FLUX.2 pipelines' encode_prompt: the tokenizer call of the pipeline's template, then a
/// stack of the decoder's hidden states. Flux2KleinPipeline: Qwen3, its chat template, hidden
/// states 9/18/27. Flux2Pipeline: Mistral-3, the system message and chat template (left-padded to
/// max_sequence_length), hidden states 10/20/30.
template <class Model>
class Flux2PromptEncoder : public PromptEncoder {
 public:
  using Tokenize = std::vector<tokenizers::Encoding> (*)(const tokenizers::Tokenizer&, const std::vector<std::string>&,
                                                          int64_t);
  using Embed = at::Tensor (*)(Model&, const at::Tensor&, const at::Tensor&, const std::vector<int64_t>&);

  Flux2PromptEncoder(std::unique_ptr<tokenizers::Tokenizer> tokenizer, std::shared_ptr<Model> encoder,
                     Tokenize tokenize, Embed embed, std::vector<int64_t> layers)
      : tokenizer_(std::move(tokenizer)),
        encoder_(std::move(encoder)),
        tokenize_(tokenize),
        embed_(embed),
        layers_(std::move(layers)) {}

  PromptEmbeds encode(const std::vector<std::string>& prompts, int64_t max_sequence_length) override {
    const auto rows = tokenize_(*tokenizer_, prompts, max_sequence_length);
    PromptEmbeds out;
    out.prompt_embeds = embed_(*encoder_, token_rows(rows, false).to(encoder_->device()),
                               token_rows(rows, true).to(encoder_->device()), layers_);
    return out;
  }

 private:
  std::unique_ptr<tokenizers::Tokenizer> tokenizer_;
  std::shared_ptr<Model> encoder_;
  Tokenize tokenize_;
  Embed embed_;
  std::vector<int64_t> layers_;
};

/// Flux2ImageProcessor.check_image_input of reference image `i` (uint8 [H, W, 3]), its error
/// naming the pipeline and the image.
void check_reference_image(const std::string& pipeline, size_t i, const at::Tensor& image) {
  try {
    check_flux2_image_input(image.size(0), image.size(1));
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, pipeline, ": reference image ", i, " (--image): ", error.what_without_backtrace());
  }
}

}  // namespace

PromptEncoderRecipe Flux2KleinPipeline::prompt_encoder_recipe() {
  return {{{"tokenizer", "text_encoder", "Qwen3ForCausalLM", {}}},
          [](const io::ModelFolder&, auto tokenizer_list, auto encoders) -> std::shared_ptr<PromptEncoder> {
            return std::make_shared<Flux2PromptEncoder<models::Qwen3ForCausalLM>>(
                std::move(tokenizer_list[0]), encoder_as<models::Qwen3ForCausalLM>(encoders[0]),
                &tokenizers::encode_flux2_klein_prompts, &models::flux2_klein_prompt_embeds,
                models::flux2_klein_hidden_states_layers());
          }};
}

PromptEncoderRecipe Flux2Pipeline::prompt_encoder_recipe() {
  // Only the layers up to the last stacked hidden state are built and loaded.
  const auto build_part = [](const io::ComponentFolder& folder) -> HeldTextEncoder {
    const auto config = models::Mistral3Config::from_json(folder.config, folder.dir + "/config.json");
    auto model = models::flux2_dev_text_encoder(config);
    const int64_t built = static_cast<int64_t>(model->language_model->model->layers->size());
    const int64_t layers = config.text_config.num_hidden_layers;
    return {model, built == layers ? std::string() : fmt::format("layers 1-{} of {}", built, layers)};
  };
  return {{{"tokenizer", "text_encoder", "Mistral3ForConditionalGeneration", build_part}},
          [](const io::ModelFolder&, auto tokenizer_list, auto encoders) -> std::shared_ptr<PromptEncoder> {
            return std::make_shared<Flux2PromptEncoder<models::Mistral3ForConditionalGeneration>>(
                std::move(tokenizer_list[0]), encoder_as<models::Mistral3ForConditionalGeneration>(encoders[0]),
                &tokenizers::encode_flux2_dev_prompts, &models::flux2_dev_prompt_embeds,
                models::flux2_dev_hidden_states_layers());
          }};
}

Flux2KleinPipeline::Flux2KleinPipeline(io::ModelFolder folder, const PipelineLoadOptions& options)
    : Flux2KleinPipeline(std::move(folder), options, "Flux2KleinPipeline") {}

Flux2KleinPipeline::Flux2KleinPipeline(io::ModelFolder folder, const PipelineLoadOptions& options,
                                       const std::string& pipeline_class)
    : DiffusionPipeline(std::move(folder), options, pipeline_class, "Flux2Transformer2DModel") {
  const auto& index = folder_.model_index();
  if (index.contains("is_distilled") && !index.at("is_distilled").is_null()) {
    TORCH_CHECK(index.at("is_distilled").is_boolean(), folder_.root(), "/model_index.json: is_distilled is ",
                index.at("is_distilled").dump(), "; expected true or false");
    is_distilled_ = index.at("is_distilled").get<bool>();
  }
}

models::Flux2Transformer2DModel& Flux2KleinPipeline::flux2_transformer() const {
  return static_cast<models::Flux2Transformer2DModel&>(*transformer_);
}

int64_t Flux2KleinPipeline::joint_attention_dim() const { return flux2_transformer().config.joint_attention_dim; }

std::vector<int64_t> Flux2KleinPipeline::latents_shape(int64_t batch, int64_t h, int64_t w) const {
  const auto& config = flux2_transformer().config;
  return {batch, config.in_channels, h, w};
}

std::string Flux2KleinPipeline::latents_layout() const { return "[B, in_channels, H/16, W/16]"; }

bool Flux2KleinPipeline::runs_cfg(const GenerateRequest& request) const {
  return request.guidance_scale.value_or(kDefaultGuidanceScale) > 1 && !is_distilled_;
}

std::string Flux2KleinPipeline::cfg_condition() const {
  return std::string("Flux2KleinPipeline runs CFG when guidance_scale (default 4) > 1 and the model is not distilled "
                     "(model_index.json: is_distilled ") +
         (is_distilled_ ? "true" : "false") + ")";
}

CallDefaults Flux2KleinPipeline::call_defaults() const {
  // No true_cfg_scale: guidance_scale is the CFG scale.
  return {/*num_inference_steps=*/50, /*guidance_scale=*/kDefaultGuidanceScale, /*true_cfg_scale=*/1.0};
}

std::optional<PromptEmbeds> Flux2KleinPipeline::call_negative_embeds(const GenerateRequest& request,
                                                                     const PreparedRequest& call,
                                                                     int64_t num_prompts) const {
  if (!call.do_cfg) return std::nullopt;
  TORCH_CHECK(request.negative_prompt_embeds || prompt_encoder_ != nullptr, class_name(),
              ": classifier-free guidance (guidance_scale ", call.guidance_scale,
              " > 1, not distilled) needs negative_prompt_embeds (the embedding of the negative prompt, \"\" by "
              "default) next to prompt_embeds; or set guidance_scale to 1");
  // diffusers encodes "" when no negative prompt is given.
  return negative_embeds(request, num_prompts, std::string());
}

at::Tensor Flux2KleinPipeline::prepare_latents(const GenerateRequest& request, int64_t batch, int64_t h,
                                               int64_t w) const {
  const models::Flux2Transformer2DModel& transformer = flux2_transformer();
  const at::Tensor latents = initial_latents(request, batch, h, w);  // [B, in_channels, h, w]
  // The 2x2 patch lives in the channels: tokens are a plain flatten of the grid.
  return latents.reshape({batch, transformer.config.in_channels, h * w})
      .permute({0, 2, 1})
      .to(transformer.device(), transformer.dtype());  // [B, N, C4]
}

double Flux2KleinPipeline::scheduler_mu(int64_t image_seq_len, int64_t steps) const {
  return schedulers::compute_empirical_mu(image_seq_len, steps);
}

std::pair<int64_t, int64_t> Flux2KleinPipeline::requested_size(const GenerateRequest& request) const {
  if (request.image.empty()) return DiffusionPipeline::requested_size(request);
  // diffusers sets height = height or image_height from the reference images in order: the first wins.
  const at::Tensor& first = request.image.front();
  // The output's size comes from the first image: an image too small to take one from is named
  // as the reference it is, before any size is derived from it.
  check_reference_image(class_name(), 0, first);
  const auto [image_height, image_width] = flux2_condition_size(first.size(0), first.size(1), vae_scale_factor_ * 2);
  return {request.height.value_or(image_height), request.width.value_or(image_width)};
}

void Flux2KleinPipeline::check_reference_images(const GenerateRequest& request, int64_t /*batch*/) const {
  for (size_t i = 0; i < request.image.size(); ++i) check_reference_image(class_name(), i, request.image[i]);
}

ReferenceTokens Flux2KleinPipeline::reference_tokens(const GenerateRequest& request, int64_t batch) const {
  if (request.image.empty()) return {};
  constexpr int64_t kTimeScale = 10;  // _prepare_image_ids' scale: image k sits at t = 10 + 10 k
  std::vector<at::Tensor> tokens;
  std::vector<at::Tensor> ids;
  for (size_t k = 0; k < request.image.size(); ++k) {
    const at::Tensor image = flux2_condition_image(request.image[k], vae_scale_factor_ * 2);  // [1, 3, H, W]
    const at::Tensor latents = encode_image_latents(image);  // [1, 4C, H/16, W/16], normalised
    const int64_t h = latents.size(2);
    const int64_t w = latents.size(3);
    // [1, 4C, h, w] -> [1, h*w, 4C]: the patch is in the channels, tokens flatten the grid.
    tokens.push_back(latents.reshape({1, latents.size(1), h * w}).permute({0, 2, 1}));
    ids.push_back(models::flux2_image_ids(1, h, w, kTimeScale + kTimeScale * static_cast<int64_t>(k)));
  }
  ReferenceTokens references;
  references.latents = at::cat(tokens, 1).repeat({batch, 1, 1});  // [B, M, 4C]
  references.ids = at::cat(ids, 1).repeat({batch, 1, 1});         // [B, M, 4]
  return references;
}

GenerateResult Flux2KleinPipeline::generate_prepared(PreparedRequest& call, const GenerateRequest& request) {
  models::Flux2Transformer2DModel& transformer = flux2_transformer();
  const auto& config = transformer.config;
  const at::Device device = call.device();
  const at::Tensor img_ids = models::flux2_image_ids(call.batch, call.h, call.w).to(device);
  std::optional<at::Tensor> guidance;
  if (config.guidance_embeds) {
    guidance = at::full({call.batch}, call.guidance_scale, at::TensorOptions().dtype(at::kFloat)).to(device);
  }

  const at::Tensor latents = denoise(
      call, request,
      [&](const PromptEmbeds& embeds, const at::Tensor& x, const at::Tensor& timestep) {
        models::Flux2Transformer2DModelInputs inputs;
        // The reference tokens follow the noise tokens at every step: [B, N + M, 4C].
        inputs.hidden_states = call.references.defined() ? at::cat({x, call.references.latents}, 1) : x;
        inputs.encoder_hidden_states = embeds.prompt_embeds;
        inputs.timestep = timestep;
        inputs.img_ids = call.references.defined() ? at::cat({img_ids, call.references.ids}, 1) : img_ids;
        inputs.txt_ids = models::flux2_text_ids(call.batch, embeds.prompt_embeds.size(1)).to(device);
        inputs.guidance = guidance;
        const at::Tensor prediction = transformer.forward(inputs);
        // Only the noise tokens' prediction steps the latents.
        return call.references.defined() ? prediction.narrow(1, 0, x.size(1)) : prediction;
      },
      [&](const at::Tensor& noise_pred, const at::Tensor& neg) {
        return neg + call.guidance_scale * (noise_pred - neg);
      });

  GenerateResult result = make_result(latents, call, call.guidance_scale);
  // Tokens back to [B, 4C, h, w]; the VAE de-normalises and unpatchifies.
  if (vae_) {
    result.image = decode_image(latents.permute({0, 2, 1}).reshape({call.batch, config.in_channels, call.h, call.w}));
  }
  return result;
}

Flux2Pipeline::Flux2Pipeline(io::ModelFolder folder, const PipelineLoadOptions& options)
    : Flux2KleinPipeline(std::move(folder), options, "Flux2Pipeline") {}

bool Flux2Pipeline::runs_cfg(const GenerateRequest&) const { return false; }

std::string Flux2Pipeline::cfg_condition() const {
  return "Flux2Pipeline never runs CFG: FLUX.2 [dev] embeds guidance_scale in the transformer";
}

CallDefaults Flux2Pipeline::call_defaults() const {
  return {/*num_inference_steps=*/50, /*guidance_scale=*/kDefaultGuidanceScale, /*true_cfg_scale=*/1.0};
}

std::optional<PromptEmbeds> Flux2Pipeline::call_negative_embeds(const GenerateRequest&, const PreparedRequest&,
                                                                int64_t) const {
  // diffusers' Flux2Pipeline takes no negative prompt at all (check() refuses one).
  return std::nullopt;
}

}  // namespace shardit::pipelines
