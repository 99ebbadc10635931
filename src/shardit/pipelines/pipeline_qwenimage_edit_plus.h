#pragma once
// diffusers' QwenImageEditPipeline (pipeline_qwenimage_edit.py) and QwenImageEditPlusPipeline
// (pipeline_qwenimage_edit_plus.py): Qwen-Image editing. Each image is resized for the text
// encoder (Qwen2.5-VL with its vision tower reads the prompt with the images) and for the VAE,
// whose normalised latents are packed after the noise tokens, each image's grid in img_shapes;
// the output size comes from the (last) image unless given; true CFG encodes the negative prompt
// with the same images. The denoising loop, latents and decode are QwenImagePipeline's.
#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/pipelines/image_processing_qwen2_vl.h"
#include "shardit/pipelines/pipeline_qwenimage.h"
#include "shardit/tokenizers/tokenizer.h"

namespace shardit::pipelines {

/// The condition image QwenImageEditPlusPipeline hands the processor: `pixels` (uint8 [H, W, 3])
/// resized (LANCZOS) to calculate_dimensions(384², W / H).
at::Tensor qwenimage_edit_plus_condition_image(const at::Tensor& pixels);

/// The edit pipelines' _get_qwen_prompt_embeds for one prompt and its condition images (uint8
/// [H, W, 3] each, as the pipeline prepared them): the Qwen2-VL processor, the pipeline's
/// template (`plus`: QwenImageEditPlusPipeline's "Picture i: ..." per image; otherwise
/// QwenImageEditPipeline's one image), Qwen2.5-VL with its vision tower, the last hidden state
/// without the template's first 64 tokens: prompt_embeds [1, L, D] and prompt_embeds_mask [1, L]
/// (all ones). `text_encoder` must be built with its vision tower.
models::QwenImagePromptEmbeds qwenimage_edit_encode_prompt(models::Qwen2_5_VLForConditionalGeneration& text_encoder,
                                                           const tokenizers::Tokenizer& tokenizer,
                                                           const Qwen2VLImageProcessorConfig& processor,
                                                           const std::string& prompt,
                                                           const std::vector<at::Tensor>& condition_images, bool plus);

/// QwenImageEditPlusPipeline.encode_prompt for one prompt and its images as loaded (uint8
/// [H, W, 3] each): each resized by qwenimage_edit_plus_condition_image, then
/// qwenimage_edit_encode_prompt with the Plus template.
models::QwenImagePromptEmbeds qwenimage_edit_plus_encode_prompt(models::Qwen2_5_VLForConditionalGeneration& text_encoder,
                                                                 const tokenizers::Tokenizer& tokenizer,
                                                                 const Qwen2VLImageProcessorConfig& processor,
                                                                 const std::string& prompt,
                                                                 const std::vector<at::Tensor>& images);

/// The most images QwenImageEditPlusPipeline takes in one call: Qwen-Image-Edit-2509 and -2511
/// are trained and documented for 1 to 3 input images.
constexpr int64_t kQwenImageEditPlusMaxImages = 3;

/// What an edit pipeline makes of one input image.
struct QwenImageEditImage {
  at::Tensor condition;  ///< uint8 [h, w, 3]: what the text encoder's processor receives
  at::Tensor vae_input;  ///< float32 [1, 3, H, W] in [-1, 1]: VaeImageProcessor.preprocess, the VAE's input
  int64_t vae_height = 0;
  int64_t vae_width = 0;
};

/// QwenImageEditPipeline's preparation of its image (uint8 [H, W, 3]) for a VAE area (pixels):
/// resized (LANCZOS) to calculate_dimensions(area, W / H); that image is the text encoder's and,
/// scaled to [-1, 1], the VAE's. A side that rounds to nothing is a named error.
QwenImageEditImage qwenimage_edit_image(const at::Tensor& pixels, int64_t vae_area);

/// QwenImageEditPlusPipeline's of one of its images: qwenimage_edit_plus_condition_image for the
/// text encoder; VaeImageProcessor.preprocess to calculate_dimensions(area, W / H) from the image
/// as given for the VAE.
QwenImageEditImage qwenimage_edit_plus_image(const at::Tensor& pixels, int64_t vae_area);

/// QwenImageEditPipeline: one image; it is resized (LANCZOS) to calculate_dimensions(area, W / H)
/// (diffusers' area 1024², GenerateRequest::max_area here), and that image is both the text
/// encoder's and the VAE's (whose preprocess keeps its size). The output size is that size unless
/// height/width are given. One prompt per call (diffusers' processor takes one image for all).
/// Defaults as diffusers: 50 steps, true_cfg_scale 4.0.
class QwenImageEditPipeline : public QwenImagePipeline {
 public:
  QwenImageEditPipeline(io::ModelFolder folder, const PipelineLoadOptions& options);
  /// Qwen2.5-VL with its vision tower on the edit template with the image, the folder's
  /// processor/preprocessor_config.json preparing the image.
  static PromptEncoderRecipe prompt_encoder_recipe();
  std::string class_name() const override { return "QwenImageEditPipeline"; }
  int64_t max_reference_images() const override { return 1; }
  bool takes_max_area() const override { return true; }
  /// The condition images of the request's images (prepare_image(...).condition).
  std::vector<at::Tensor> prompt_images(const GenerateRequest& request) const override;
  /// Each image's VAE input encoded, normalised ((z - latents_mean) / latents_std) and packed 2x2
  /// to its own tokens, all concatenated in order and repeated for every image of the batch; ids:
  /// each image's img_shapes entry (1, H / 16, W / 16), int64 [K, 3].
  ReferenceTokens reference_tokens(const GenerateRequest& request, int64_t batch) const override;
  /// What the pipeline makes of one image (uint8 [H, W, 3]) for a VAE area `vae_area` (pixels).
  virtual QwenImageEditImage prepare_image(const at::Tensor& pixels, int64_t vae_area) const;
  /// The VAE area of a request: its max_area, else diffusers' 1024².
  static int64_t vae_area(const GenerateRequest& request);

 protected:
  QwenImageEditPipeline(io::ModelFolder folder, const PipelineLoadOptions& options, const std::string& pipeline_class);
  /// The request's size, else the size of the image the output follows (output_size_image).
  std::pair<int64_t, int64_t> requested_size(const GenerateRequest& request) const override;
  /// One prompt; every image large enough for its sizes.
  void check_reference_images(const GenerateRequest& request, int64_t batch) const override;
  /// The image whose aspect gives the default output size: the first (the only one here).
  virtual size_t output_size_image(const GenerateRequest& request) const;
  /// Refuses an image (uint8 [H, W, 3]) whose sizes round to nothing at the VAE area `area`.
  virtual void check_image_size(const at::Tensor& pixels, int64_t area) const;
};

/// QwenImageEditPlusPipeline: 1 to kQwenImageEditPlusMaxImages images; each resized (LANCZOS) to
/// calculate_dimensions(384², W / H) for the text encoder (prompt "Picture i: ..." per image) and
/// prepared for the VAE at calculate_dimensions(area, W / H) from the image as given. The output
/// size follows the last image. One prompt per call, as diffusers.
class QwenImageEditPlusPipeline : public QwenImageEditPipeline {
 public:
  QwenImageEditPlusPipeline(io::ModelFolder folder, const PipelineLoadOptions& options);
  /// As QwenImageEditPipeline's, with the Plus template ("Picture i: ..." per image).
  static PromptEncoderRecipe prompt_encoder_recipe();
  std::string class_name() const override { return "QwenImageEditPlusPipeline"; }
  int64_t max_reference_images() const override { return kQwenImageEditPlusMaxImages; }
  QwenImageEditImage prepare_image(const at::Tensor& pixels, int64_t vae_area) const override;

 protected:
  size_t output_size_image(const GenerateRequest& request) const override;
  /// Also at the 384² condition area.
  void check_image_size(const at::Tensor& pixels, int64_t area) const override;
};

}  // namespace shardit::pipelines
