#include "shardit/pipelines/pipeline_qwenimage_edit_plus.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>

#include "shardit/io/json.h"
#include "shardit/pipelines/image_processor.h"
#include "shardit/tokenizers/prompt_templates.h"

namespace shardit::pipelines {

at::Tensor qwenimage_edit_plus_condition_image(const at::Tensor& pixels) {
  TORCH_CHECK(pixels.defined() && pixels.dim() == 3 && pixels.size(0) > 0 && pixels.size(1) > 0,
              "QwenImageEditPlusPipeline: an image must be uint8 [H, W, 3] with pixels, got ",
              pixels.defined() ? pixels.sizes() : c10::IntArrayRef{});
  // calculate_dimensions(CONDITION_IMAGE_SIZE, image_width / image_height): {width, height}
  const auto [width, height] = qwenimage_edit_calculate_dimensions(
      kQwenImageEditConditionArea, static_cast<double>(pixels.size(1)) / static_cast<double>(pixels.size(0)));
  TORCH_CHECK(width > 0 && height > 0, "QwenImageEditPlusPipeline: an image of ", pixels.size(1), "x", pixels.size(0),
              " (width x height) has no condition size at the 384² area (", width, "x", height,
              "): its aspect ratio is too extreme; crop it");
  return resize_lanczos(pixels, height, width);
}

models::QwenImagePromptEmbeds qwenimage_edit_encode_prompt(models::Qwen2_5_VLForConditionalGeneration& text_encoder,
                                                           const tokenizers::Tokenizer& tokenizer,
                                                           const Qwen2VLImageProcessorConfig& processor,
                                                           const std::string& prompt,
                                                           const std::vector<at::Tensor>& condition_images, bool plus) {
  TORCH_CHECK(!condition_images.empty(), "Qwen-Image editing: no image given; the edit pipelines need at least one");
  TORCH_CHECK(plus || condition_images.size() == 1, "QwenImageEditPipeline's template holds one image, got ",
              condition_images.size());
  TORCH_CHECK(text_encoder.visual != nullptr, "Qwen-Image editing: the text encoder has no vision tower (its "
              "config.json has no vision_config, or the folder lists no processor)");
  std::vector<Qwen2VLImageInputs> inputs;
  for (const at::Tensor& image : condition_images) inputs.push_back(qwen2_vl_preprocess(image, processor));
  const Qwen2VLBatchInputs batch = qwen2_vl_batch(inputs);
  const std::vector<int64_t> tokens = qwen2_vl_image_token_counts(inputs, processor.merge_size);
  const tokenizers::Encoding encoding = plus ? tokenizers::encode_qwenimage_edit_plus_prompt(tokenizer, prompt, tokens)
                                             : tokenizers::encode_qwenimage_edit_prompt(tokenizer, prompt, tokens[0]);
  // [1, S]
  const at::Device device = text_encoder.device();
  const at::Tensor input_ids = at::tensor(encoding.input_ids, at::kLong).unsqueeze(0).to(device);
  const at::Tensor attention_mask = at::tensor(encoding.attention_mask, at::kLong).unsqueeze(0).to(device);
  const models::DecoderHiddenStates hidden = text_encoder.forward_with_images(
      input_ids, attention_mask, batch.pixel_values.to(device), batch.image_grid_thw.to(device));
  return models::qwenimage_prompt_embeds_from_hidden(hidden.last_hidden_state, attention_mask,
                                                     tokenizers::kQwenImageEditDropIdx);
}

models::QwenImagePromptEmbeds qwenimage_edit_plus_encode_prompt(models::Qwen2_5_VLForConditionalGeneration& text_encoder,
                                                                 const tokenizers::Tokenizer& tokenizer,
                                                                 const Qwen2VLImageProcessorConfig& processor,
                                                                 const std::string& prompt,
                                                                 const std::vector<at::Tensor>& images) {
  std::vector<at::Tensor> condition;
  for (const at::Tensor& image : images) condition.push_back(qwenimage_edit_plus_condition_image(image));
  return qwenimage_edit_encode_prompt(text_encoder, tokenizer, processor, prompt, condition, /*plus=*/true);
}

namespace {

/// The edit pipelines' encode_prompt: each prompt read with the call's condition images, rows
/// right-padded with zeros to the longest (mask 0 there), as _get_qwen_prompt_embeds pads them.
/// max_sequence_length does not cut them (diffusers' edit encode_prompt does not either).
class QwenImageEditPromptEncoder : public PromptEncoder {
 public:
  QwenImageEditPromptEncoder(std::string pipeline, std::unique_ptr<tokenizers::Tokenizer> tokenizer,
                             std::shared_ptr<models::Qwen2_5_VLForConditionalGeneration> encoder,
                             Qwen2VLImageProcessorConfig processor, bool plus)
      : pipeline_(std::move(pipeline)),
        tokenizer_(std::move(tokenizer)),
        encoder_(std::move(encoder)),
        processor_(processor),
        plus_(plus) {}

  PromptEmbeds encode(const std::vector<std::string>& /*prompts*/, int64_t /*max_sequence_length*/) override {
    TORCH_CHECK(false, pipeline_, " encodes each prompt with the images it edits; give the images (--image)");
  }

  PromptEmbeds encode(const std::vector<std::string>& prompts, const std::vector<at::Tensor>& images,
                      int64_t /*max_sequence_length*/) override {
    std::vector<at::Tensor> rows;
    int64_t longest = 0;
    for (const std::string& prompt : prompts) {
      rows.push_back(qwenimage_edit_encode_prompt(*encoder_, *tokenizer_, processor_, prompt, images, plus_)
                         .prompt_embeds.squeeze(0));  // [L_i, D]
      longest = std::max(longest, rows.back().size(0));
    }
    PromptEmbeds out;
    out.prompt_embeds = at::zeros({static_cast<int64_t>(rows.size()), longest, rows.front().size(1)},
                                  rows.front().options());
    out.prompt_embeds_mask = at::zeros({static_cast<int64_t>(rows.size()), longest}, at::kLong);
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t length = rows[i].size(0);
      out.prompt_embeds.select(0, static_cast<int64_t>(i)).narrow(0, 0, length).copy_(rows[i]);
      out.prompt_embeds_mask->select(0, static_cast<int64_t>(i)).narrow(0, 0, length).fill_(1);
    }
    return out;
  }

 private:
  std::string pipeline_;
  std::unique_ptr<tokenizers::Tokenizer> tokenizer_;
  std::shared_ptr<models::Qwen2_5_VLForConditionalGeneration> encoder_;
  Qwen2VLImageProcessorConfig processor_;
  bool plus_;
};

PromptEncoderRecipe edit_prompt_encoder_recipe(const std::string& pipeline, bool plus) {
  return {{{"tokenizer", "text_encoder", "Qwen2_5_VLForConditionalGeneration", {}}},
          [pipeline, plus](const io::ModelFolder& folder, auto tokenizer_list,
                           auto encoders) -> std::shared_ptr<PromptEncoder> {
            const std::string path = folder.root() + "/processor/preprocessor_config.json";
            return std::make_shared<QwenImageEditPromptEncoder>(
                pipeline, std::move(tokenizer_list[0]),
                encoder_as<models::Qwen2_5_VLForConditionalGeneration>(encoders[0]),
                Qwen2VLImageProcessorConfig::from_json(io::read_json_file(path), path), plus);
          }};
}

/// calculate_dimensions(area, W / H) of an image of `height` x `width` pixels, {width, height},
/// refused by name when a side rounds to nothing.
std::pair<int64_t, int64_t> edit_size(const std::string& pipeline, int64_t height, int64_t width, int64_t area) {
  const auto size = qwenimage_edit_calculate_dimensions(area, static_cast<double>(width) / static_cast<double>(height));
  TORCH_CHECK(size.first > 0 && size.second > 0, pipeline, ": an image of ", width, "x", height,
              " (width x height) has no size at the area ", area, " (calculate_dimensions gives ", size.first, "x",
              size.second, "): its aspect ratio is too extreme for that area; crop it or give a larger --max-area");
  return size;
}

}  // namespace

PromptEncoderRecipe QwenImageEditPipeline::prompt_encoder_recipe() {
  return edit_prompt_encoder_recipe("QwenImageEditPipeline", /*plus=*/false);
}

PromptEncoderRecipe QwenImageEditPlusPipeline::prompt_encoder_recipe() {
  return edit_prompt_encoder_recipe("QwenImageEditPlusPipeline", /*plus=*/true);
}

QwenImageEditPipeline::QwenImageEditPipeline(io::ModelFolder folder, const PipelineLoadOptions& options)
    : QwenImageEditPipeline(std::move(folder), options, "QwenImageEditPipeline") {}

QwenImageEditPipeline::QwenImageEditPipeline(io::ModelFolder folder, const PipelineLoadOptions& options,
                                             const std::string& pipeline_class)
    : QwenImagePipeline(std::move(folder), options, pipeline_class) {
  // The text encoder reads the images only with a processor: without one the registry builds it
  // without its vision tower.
  const auto listed = folder_.components();
  if (options.load_text_encoders && std::find(listed.begin(), listed.end(), "text_encoder") != listed.end()) {
    TORCH_CHECK(std::find(listed.begin(), listed.end(), "processor") != listed.end(), folder_.root(),
                "/model_index.json: a ", pipeline_class, " reads its images with the text encoder's processor, "
                "but the folder lists no 'processor' component; give a Qwen-Image-Edit folder (or pass prompt "
                "embeddings without loading the text encoder)");
  }
}

QwenImageEditPlusPipeline::QwenImageEditPlusPipeline(io::ModelFolder folder, const PipelineLoadOptions& options)
    : QwenImageEditPipeline(std::move(folder), options, "QwenImageEditPlusPipeline") {}

int64_t QwenImageEditPipeline::vae_area(const GenerateRequest& request) {
  return request.max_area.value_or(kQwenImageEditVaeArea);
}

QwenImageEditImage qwenimage_edit_image(const at::Tensor& pixels, int64_t area) {
  const auto [width, height] = edit_size("QwenImageEditPipeline", pixels.size(0), pixels.size(1), area);
  QwenImageEditImage out;
  // image_processor.resize to the calculated size: the processor's image, and preprocess's
  // input at the same size (its resize then keeps it).
  out.condition = resize_lanczos(pixels, height, width);
  out.vae_input = pixels_to_model_input(out.condition);
  out.vae_height = height;
  out.vae_width = width;
  return out;
}

QwenImageEditImage qwenimage_edit_plus_image(const at::Tensor& pixels, int64_t area) {
  const auto [width, height] = edit_size("QwenImageEditPlusPipeline", pixels.size(0), pixels.size(1), area);
  QwenImageEditImage out;
  out.condition = qwenimage_edit_plus_condition_image(pixels);
  // VaeImageProcessor.preprocess(image, vae_height, vae_width) from the image as given.
  out.vae_input = kontext_condition_image(pixels, height, width);
  out.vae_height = height;
  out.vae_width = width;
  return out;
}

QwenImageEditImage QwenImageEditPipeline::prepare_image(const at::Tensor& pixels, int64_t area) const {
  return qwenimage_edit_image(pixels, area);
}

QwenImageEditImage QwenImageEditPlusPipeline::prepare_image(const at::Tensor& pixels, int64_t area) const {
  return qwenimage_edit_plus_image(pixels, area);
}

std::vector<at::Tensor> QwenImageEditPipeline::prompt_images(const GenerateRequest& request) const {
  std::vector<at::Tensor> images;
  for (const at::Tensor& image : request.image) images.push_back(prepare_image(image, vae_area(request)).condition);
  return images;
}

void QwenImageEditPipeline::check_image_size(const at::Tensor& pixels, int64_t area) const {
  edit_size(class_name(), pixels.size(0), pixels.size(1), area);
}

void QwenImageEditPlusPipeline::check_image_size(const at::Tensor& pixels, int64_t area) const {
  QwenImageEditPipeline::check_image_size(pixels, area);
  edit_size(class_name(), pixels.size(0), pixels.size(1), kQwenImageEditConditionArea);
}

size_t QwenImageEditPipeline::output_size_image(const GenerateRequest& /*request*/) const { return 0; }

size_t QwenImageEditPlusPipeline::output_size_image(const GenerateRequest& request) const {
  return request.image.size() - 1;  // diffusers: image[-1].size
}

std::pair<int64_t, int64_t> QwenImageEditPipeline::requested_size(const GenerateRequest& request) const {
  TORCH_CHECK(!request.image.empty(), class_name(), " edits images: give 1 to ", max_reference_images(),
              " with --image (the image field of /v1/images/edits)");
  const at::Tensor& image = request.image[output_size_image(request)];
  // calculate_dimensions(1024 * 1024, image_width / image_height) of that image.
  const auto [width, height] = edit_size(class_name(), image.size(0), image.size(1), vae_area(request));
  return {request.height.value_or(height), request.width.value_or(width)};
}

void QwenImageEditPipeline::check_reference_images(const GenerateRequest& request, int64_t /*batch*/) const {
  const int64_t prompts =
      request.prompt_embeds ? request.prompt_embeds->num_prompts() : static_cast<int64_t>(request.prompt.size());
  TORCH_CHECK(prompts == 1, class_name(), " takes one prompt per call (as diffusers' ", class_name(),
              "), got ", prompts, "; edit with one prompt at a time (--num-images gives several images of it)");
  for (size_t i = 0; i < request.image.size(); ++i) {
    const at::Tensor& image = request.image[i];
    try {
      check_image_size(image, vae_area(request));
    } catch (const c10::Error& error) {
      TORCH_CHECK(false, "reference image ", i, " (--image): ", error.what_without_backtrace());
    }
  }
}

ReferenceTokens QwenImageEditPipeline::reference_tokens(const GenerateRequest& request, int64_t batch) const {
  if (request.image.empty()) return {};
  std::vector<at::Tensor> tokens;
  std::vector<int64_t> grids;
  for (const at::Tensor& pixels : request.image) {
    const QwenImageEditImage image = prepare_image(pixels, vae_area(request));
    const at::Tensor latents = encode_image_latents(image.vae_input);  // [1, C, H/8, W/8], normalised
    tokens.push_back(pack_latents_2x2(latents));                       // [1, (H/16)(W/16), 4C]
    grids.insert(grids.end(), {1, latents.size(2) / 2, latents.size(3) / 2});
  }
  ReferenceTokens references;
  references.latents = at::cat(tokens, 1).repeat({batch, 1, 1});  // [B, M, 4C]
  references.ids = at::tensor(grids, at::kLong).view({-1, 3});      // [K, 3]
  return references;
}

}  // namespace shardit::pipelines
