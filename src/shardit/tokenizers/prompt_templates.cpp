#include "shardit/tokenizers/prompt_templates.h"

#include <c10/util/Exception.h>

namespace shardit::tokenizers {

namespace {

constexpr std::string_view kQwenImagePrefix =
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n";
constexpr std::string_view kQwenImageSuffix = "<|im_end|>\n<|im_start|>assistant\n";

// QwenImageEditPlusPipeline.prompt_template_encode (the same suffix as QwenImagePipeline's), and
// the text it puts before the prompt for image i (from 1).
constexpr std::string_view kQwenImageEditPrefix =
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n";
constexpr std::string_view kImagePad = "<|image_pad|>";

// Qwen3's chat template for one user message, with the generation prompt and the empty think
// block that enable_thinking=False adds.
constexpr std::string_view kFlux2KleinPrefix = "<|im_start|>user\n";
constexpr std::string_view kFlux2KleinSuffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";

// Mistral-Small-3.1's chat template for [system, user] messages whose contents are text blocks,
// without a generation prompt: bos_token, the system turn, the user turn.
constexpr std::string_view kFlux2DevPrefix = "<s>[SYSTEM_PROMPT]";
constexpr std::string_view kFlux2DevUserStart = "[/SYSTEM_PROMPT][INST]";
constexpr std::string_view kFlux2DevSuffix = "[/INST]";
// Flux2Pipeline.format_input strips the image placeholder from text prompts.
constexpr std::string_view kImageToken = "[IMG]";

std::string without_image_tokens(std::string_view prompt) {
  std::string out;
  out.reserve(prompt.size());
  size_t pos = 0;
  while (pos <= prompt.size()) {
    const size_t found = prompt.find(kImageToken, pos);
    if (found == std::string_view::npos) {
      out.append(prompt.substr(pos));
      break;
    }
    out.append(prompt.substr(pos, found - pos));
    pos = found + kImageToken.size();
  }
  return out;
}

}  // namespace

const std::string_view kFlux2DevSystemMessage =
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation.";

PromptTemplate parse_prompt_template(const std::string& name) {
  if (name.empty() || name == "none") return PromptTemplate::None;
  if (name == "qwenimage") return PromptTemplate::QwenImage;
  if (name == "flux2_klein") return PromptTemplate::Flux2Klein;
  if (name == "flux2_dev") return PromptTemplate::Flux2Dev;
  TORCH_CHECK(false, "unknown prompt template '", name, "' (expected qwenimage, flux2_klein or flux2_dev)");
}

std::string apply_prompt_template(PromptTemplate tmpl, std::string_view prompt) {
  switch (tmpl) {
    case PromptTemplate::None: return std::string(prompt);
    case PromptTemplate::QwenImage: return std::string(kQwenImagePrefix).append(prompt).append(kQwenImageSuffix);
    case PromptTemplate::Flux2Klein: return std::string(kFlux2KleinPrefix).append(prompt).append(kFlux2KleinSuffix);
    case PromptTemplate::Flux2Dev:
      return std::string(kFlux2DevPrefix)
          .append(kFlux2DevSystemMessage)
          .append(kFlux2DevUserStart)
          .append(without_image_tokens(prompt))
          .append(kFlux2DevSuffix);
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled prompt template");
}

namespace {

std::vector<std::string> templated(PromptTemplate tmpl, const std::vector<std::string>& prompts) {
  std::vector<std::string> texts;
  texts.reserve(prompts.size());
  for (const auto& p : prompts) texts.push_back(apply_prompt_template(tmpl, p));
  return texts;
}

}  // namespace

std::vector<Encoding> encode_qwenimage_prompts(const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                               int64_t max_length) {
  return tokenizer(templated(PromptTemplate::QwenImage, prompts), max_length, Padding::Longest);
}

std::vector<Encoding> encode_flux2_klein_prompts(const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                                 int64_t max_sequence_length) {
  return tokenizer(templated(PromptTemplate::Flux2Klein, prompts), max_sequence_length, Padding::MaxLength);
}

std::vector<Encoding> encode_flux2_dev_prompts(const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                               int64_t max_sequence_length) {
  return tokenizer(templated(PromptTemplate::Flux2Dev, prompts), max_sequence_length, Padding::MaxLength,
                   /*add_special_tokens=*/false);
}

std::string expand_image_pads(std::string_view text, const std::vector<int64_t>& tokens_per_image) {
  std::string out;
  size_t start = 0;
  size_t image = 0;
  for (size_t at = text.find(kImagePad); at != std::string_view::npos; at = text.find(kImagePad, start)) {
    TORCH_CHECK(image < tokens_per_image.size(), "Qwen2VLProcessor: the text has more ", kImagePad,
                " tokens than the ", tokens_per_image.size(), " images given");
    out.append(text.substr(start, at - start));
    for (int64_t i = 0; i < tokens_per_image[image]; ++i) out.append(kImagePad);
    ++image;
    start = at + kImagePad.size();
  }
  TORCH_CHECK(image == tokens_per_image.size(), "Qwen2VLProcessor: the text has ", image, " ", kImagePad,
              " tokens but ", tokens_per_image.size(), " images were given");
  out.append(text.substr(start));
  return out;
}

std::string qwenimage_edit_plus_text(std::string_view prompt, int64_t num_images) {
  TORCH_CHECK(num_images >= 0, "qwenimage_edit_plus_text: negative image count ", num_images);
  std::string images;
  for (int64_t i = 1; i <= num_images; ++i) {
    images.append("Picture ").append(std::to_string(i)).append(": <|vision_start|>").append(kImagePad).append(
        "<|vision_end|>");
  }
  return std::string(kQwenImageEditPrefix).append(images).append(prompt).append(kQwenImageSuffix);
}

std::string qwenimage_edit_text(std::string_view prompt) {
  return std::string(kQwenImageEditPrefix)
      .append("<|vision_start|>")
      .append(kImagePad)
      .append("<|vision_end|>")
      .append(prompt)
      .append(kQwenImageSuffix);
}

namespace {

/// `text` with its pads expanded, tokenized as Qwen2VLProcessor does for one prompt.
Encoding encode_qwenimage_edit_text(const Tokenizer& tokenizer, const std::string& text,
                                    const std::vector<int64_t>& tokens_per_image) {
  const std::vector<int64_t> ids = tokenizer.encode(expand_image_pads(text, tokens_per_image));
  Encoding out;
  out.input_ids = ids;
  out.attention_mask.assign(ids.size(), 1);
  return out;
}

}  // namespace

Encoding encode_qwenimage_edit_plus_prompt(const Tokenizer& tokenizer, std::string_view prompt,
                                           const std::vector<int64_t>& tokens_per_image) {
  return encode_qwenimage_edit_text(
      tokenizer, qwenimage_edit_plus_text(prompt, static_cast<int64_t>(tokens_per_image.size())), tokens_per_image);
}

Encoding encode_qwenimage_edit_prompt(const Tokenizer& tokenizer, std::string_view prompt, int64_t image_tokens) {
  return encode_qwenimage_edit_text(tokenizer, qwenimage_edit_text(prompt), {image_tokens});
}

}  // namespace shardit::tokenizers
