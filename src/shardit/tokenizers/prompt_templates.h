#pragma once
// The prompt templates the pipelines wrap around a user's prompt before tokenizing, and the
// tokenizer calls they make (diffusers' QwenImagePipeline, Flux2KleinPipeline and Flux2Pipeline).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardit/tokenizers/tokenizer.h"

namespace shardit::tokenizers {

/// Prompt templates by pipeline.
enum class PromptTemplate {
  None,
  QwenImage,   ///< QwenImagePipeline.prompt_template_encode (system prompt + user turn)
  Flux2Klein,  ///< Qwen3 chat template, add_generation_prompt=True, enable_thinking=False
  Flux2Dev,    ///< Mistral-Small-3.1's chat template: BOS, Flux2Pipeline's system message, the user turn
};

/// Parses "qwenimage" | "flux2_klein" | "flux2_dev" (and "" / "none").
PromptTemplate parse_prompt_template(const std::string& name);

/// QwenImagePipeline: the number of template tokens before the prompt, dropped from the encoder
/// output (`prompt_template_encode_start_idx`).
constexpr int64_t kQwenImageDropIdx = 34;
/// QwenImageEditPlusPipeline's `prompt_template_encode_start_idx`: its template's tokens before
/// the user turn's text.
constexpr int64_t kQwenImageEditDropIdx = 64;
/// QwenImagePipeline.tokenizer_max_length: prompt tokens kept after the template prefix.
constexpr int64_t kQwenImageTokenizerMaxLength = 1024;
/// Flux2KleinPipeline's default max_sequence_length.
constexpr int64_t kFlux2KleinMaxSequenceLength = 512;

/// Flux2Pipeline's default max_sequence_length.
constexpr int64_t kFlux2DevMaxSequenceLength = 512;
/// Flux2Pipeline's system message (pipeline_flux2.py SYSTEM_MESSAGE; one newline after "object").
extern const std::string_view kFlux2DevSystemMessage;

/// `prompt` inside the template (the text the pipeline hands to the tokenizer).
std::string apply_prompt_template(PromptTemplate tmpl, std::string_view prompt);

/// QwenImagePipeline's call: the templated prompts, `max_length` = 1024 + 34 by default, truncated,
/// right-padded to the longest row with the pad token. The encoder drops the first
/// kQwenImageDropIdx valid tokens of each row afterwards.
std::vector<Encoding> encode_qwenimage_prompts(const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                               int64_t max_length = kQwenImageTokenizerMaxLength + kQwenImageDropIdx);

/// Flux2KleinPipeline's call: each prompt in the chat template, padded ("max_length") and
/// truncated to `max_sequence_length`.
std::vector<Encoding> encode_flux2_klein_prompts(const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                                 int64_t max_sequence_length = kFlux2KleinMaxSequenceLength);

/// Flux2Pipeline's call (`format_input` + the processor's apply_chat_template): every "[IMG]"
/// removed from each prompt, the chat template rendered (it writes the BOS itself, so the
/// tokenizer adds no special tokens), all prompts in one call, truncated to the first
/// `max_sequence_length` tokens (a note says how many were dropped) and padded to that length on
/// the tokenizer's padding side (LEFT with <pad> for FLUX.2 [dev]'s folder).
std::vector<Encoding> encode_flux2_dev_prompts(const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                               int64_t max_sequence_length = kFlux2DevMaxSequenceLength);

/// Qwen2VLProcessor's text side: the i-th "<|image_pad|>" of `text` repeated
/// `tokens_per_image[i]` times (grid_t * grid_h * grid_w / merge_size², the tokens image i
/// becomes after the vision tower's merger). Fewer or more pads than images is an error naming
/// both counts.
std::string expand_image_pads(std::string_view text, const std::vector<int64_t>& tokens_per_image);

/// QwenImageEditPlusPipeline._get_qwen_prompt_embeds' text for one prompt and `num_images`
/// images: "Picture i: <|vision_start|><|image_pad|><|vision_end|>" for each, then the prompt,
/// in QwenImageEditPlusPipeline.prompt_template_encode (the editing system prompt).
std::string qwenimage_edit_plus_text(std::string_view prompt, int64_t num_images);

/// That text with its pads expanded, tokenized as the processor does (no truncation; one
/// prompt, so no padding; the mask all ones).
Encoding encode_qwenimage_edit_plus_prompt(const Tokenizer& tokenizer, std::string_view prompt,
                                           const std::vector<int64_t>& tokens_per_image);

/// QwenImageEditPipeline's text for one prompt: its template (the editing system prompt) holds
/// one "<|vision_start|><|image_pad|><|vision_end|>" before the prompt.
std::string qwenimage_edit_text(std::string_view prompt);

/// That text with its one pad expanded to `image_tokens`, tokenized as the processor does.
Encoding encode_qwenimage_edit_prompt(const Tokenizer& tokenizer, std::string_view prompt, int64_t image_tokens);

}  // namespace shardit::tokenizers
