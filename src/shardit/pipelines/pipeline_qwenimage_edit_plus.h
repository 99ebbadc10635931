#pragma once
// diffusers' QwenImageEditPlusPipeline (pipeline_qwenimage_edit_plus.py), its prompt encoding so
// far: the condition images as __call__ prepares them (calculate_dimensions to the 384² area,
// LANCZOS) and _get_qwen_prompt_embeds (the Qwen2-VL processor, Qwen2.5-VL with its vision tower,
// the last hidden state under the mask without the template's first 64 tokens). The denoising
// loop, reference latents and the pipeline-table row are still to come.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/pipelines/image_processing_qwen2_vl.h"
#include "shardit/tokenizers/tokenizer.h"

namespace shardit::pipelines {

/// The condition image the pipeline hands the processor: `pixels` (uint8 [H, W, 3]) resized
/// (LANCZOS) to calculate_dimensions(384², W / H).
at::Tensor qwenimage_edit_plus_condition_image(const at::Tensor& pixels);

/// QwenImageEditPlusPipeline.encode_prompt for one prompt and its images (uint8 [H, W, 3] each,
/// as loaded): prompt_embeds [1, L, D] and prompt_embeds_mask [1, L] (all ones: one prompt).
/// `text_encoder` must be built with its vision tower; images beyond what it can take are the
/// caller's to refuse.
models::QwenImagePromptEmbeds qwenimage_edit_plus_encode_prompt(models::Qwen2_5_VLForConditionalGeneration& text_encoder,
                                                                 const tokenizers::Tokenizer& tokenizer,
                                                                 const Qwen2VLImageProcessorConfig& processor,
                                                                 const std::string& prompt,
                                                                 const std::vector<at::Tensor>& images);

}  // namespace shardit::pipelines
