#include "shardit/pipelines/pipeline_qwenimage_edit_plus.h"

#include <c10/util/Exception.h>

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
  return resize_lanczos(pixels, height, width);
}

models::QwenImagePromptEmbeds qwenimage_edit_plus_encode_prompt(models::Qwen2_5_VLForConditionalGeneration& text_encoder,
                                                                 const tokenizers::Tokenizer& tokenizer,
                                                                 const Qwen2VLImageProcessorConfig& processor,
                                                                 const std::string& prompt,
                                                                 const std::vector<at::Tensor>& images) {
  TORCH_CHECK(!images.empty(), "QwenImageEditPlusPipeline: no image given; the edit pipeline needs at least one");
  std::vector<Qwen2VLImageInputs> inputs;
  for (const at::Tensor& image : images) inputs.push_back(qwen2_vl_preprocess(qwenimage_edit_plus_condition_image(image), processor));
  const Qwen2VLBatchInputs batch = qwen2_vl_batch(inputs);
  const tokenizers::Encoding encoding = tokenizers::encode_qwenimage_edit_plus_prompt(
      tokenizer, prompt, qwen2_vl_image_token_counts(inputs, processor.merge_size));
  // [1, S]
  const at::Tensor input_ids = at::tensor(encoding.input_ids, at::kLong).unsqueeze(0);
  const at::Tensor attention_mask = at::tensor(encoding.attention_mask, at::kLong).unsqueeze(0);
  const models::DecoderHiddenStates hidden =
      text_encoder.forward_with_images(input_ids, attention_mask, batch.pixel_values, batch.image_grid_thw);
  return models::qwenimage_prompt_embeds_from_hidden(hidden.last_hidden_state, attention_mask,
                                                     tokenizers::kQwenImageEditDropIdx);
}

}  // namespace shardit::pipelines
