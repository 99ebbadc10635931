#pragma once
// What diffusers' image processors and the editing pipelines do to a user's image before the VAE
// encoder: Flux2ImageProcessor (size checks, resize to a target area, flooring to multiples of
// 16, centre crop) for FLUX.2 [klein] and [dev], and FluxKontextPipeline's _auto_resize to the
// preferred resolution nearest in aspect, through VaeImageProcessor.resize. Resizing is Pillow's
// LANCZOS (Image.resize with Image.LANCZOS), computed as Pillow computes it.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace shardit::pipelines {

/// Pillow's Image.resize(size, Image.LANCZOS) of uint8 [H, W, 3] pixels to [height, width, 3]
/// (separable, support 3, its fixed-point coefficients and rounding).
at::Tensor resize_lanczos(const at::Tensor& pixels, int64_t height, int64_t width);

/// Pillow's Image.resize(size, Image.BICUBIC) (support 2, a = -0.5), computed as resize_lanczos.
at::Tensor resize_bicubic(const at::Tensor& pixels, int64_t height, int64_t width);

/// Flux2ImageProcessor.check_image_input: each side >= 64 and the aspect ratio <= 8:1, else an
/// error with diffusers' text ("Image too small: 200×50. Both dimensions must be at least 64px").
void check_flux2_image_input(int64_t height, int64_t width);

/// The size flux2_condition_image gives an image of `height` x `width` pixels, {height, width},
/// without touching pixels (the FLUX.2 pipelines take the output size from it).
std::pair<int64_t, int64_t> flux2_condition_size(int64_t height, int64_t width, int64_t multiple_of = 16);

/// The FLUX.2 pipelines' preparation of one reference image (uint8 [H, W, 3]): checked, resized
/// to a 1024² area when larger, sides floored to multiples of `multiple_of` (16), centre-cropped,
/// and scaled to [-1, 1]: float32 [1, 3, h, w].
at::Tensor flux2_condition_image(const at::Tensor& pixels, int64_t multiple_of = 16);

/// diffusers' PREFERRED_KONTEXT_RESOLUTIONS as {width, height}.
const std::vector<std::pair<int64_t, int64_t>>& preferred_kontext_resolutions();

/// FluxKontextPipeline's size for its input image of `height` x `width` pixels: the image's size
/// floored to multiples of its image processor's factor (2 x `vae_scale_factor`:
/// get_default_height_width), then with `auto_resize` the preferred resolution whose aspect
/// (of that floored size) is nearest, ties to the smaller width; then floored to multiples of
/// `multiple_of` (2 x the VAE scale factor). {height, width}. An image under the factor on a side
/// is a named error.
std::pair<int64_t, int64_t> kontext_image_size(int64_t height, int64_t width, bool auto_resize,
                                               int64_t vae_scale_factor = 8, int64_t multiple_of = 16);

/// FluxKontextPipeline's preparation of its image (uint8 [H, W, 3]): resized (LANCZOS) to
/// `height` x `width` when it differs, and scaled to [-1, 1]: float32 [1, 3, height, width].
at::Tensor kontext_condition_image(const at::Tensor& pixels, int64_t height, int64_t width);

/// uint8 [H, W, 3] -> float32 [1, 3, H, W] in [-1, 1] (x / 255 * 2 - 1, VaeImageProcessor's
/// to_tensor then normalize).
at::Tensor pixels_to_model_input(const at::Tensor& pixels);

}  // namespace shardit::pipelines
