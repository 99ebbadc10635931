#pragma once
// What Qwen2.5-VL's processor does to an image before the vision tower (transformers'
// models/qwen2_vl/image_processing_qwen2_vl.py, Qwen2VLImageProcessor, and
// processing_qwen2_5_vl.py's expansion of <|image_pad|>), and the size QwenImageEditPlusPipeline
// gives each condition image first (pipeline_qwenimage_edit_plus.py, calculate_dimensions).
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace shardit::pipelines {

/// preprocessor_config.json of Qwen2VLImageProcessor (the keys and defaults of transformers'
/// class; `min_pixels`/`max_pixels` win over `size.shortest_edge`/`size.longest_edge`, as there).
struct Qwen2VLImageProcessorConfig {
  int64_t min_pixels = 56 * 56;
  int64_t max_pixels = 28 * 28 * 1280;
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t merge_size = 2;
  bool do_resize = true;
  bool do_rescale = true;
  bool do_normalize = true;
  double rescale_factor = 1.0 / 255.0;
  std::array<double, 3> image_mean{0.48145466, 0.4578275, 0.40821073};
  std::array<double, 3> image_std{0.26862954, 0.26130258, 0.27577711};

  /// `source` names the file in errors. Refuses a resample other than BICUBIC (3).
  static Qwen2VLImageProcessorConfig from_json(const nlohmann::json& json, const std::string& source);
};

/// transformers' smart_resize: each side rounded (half to even) to a multiple of `factor`, then,
/// when the area leaves [min_pixels, max_pixels], both scaled by one factor beta and floored
/// (too large; at least `factor`) or ceiled (too small). {height, width}. An aspect ratio over
/// 200 is an error with transformers' text.
std::pair<int64_t, int64_t> qwen2_vl_smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                                  int64_t max_pixels);

/// One image as the vision tower takes it.
struct Qwen2VLImageInputs {
  /// [grid_t * grid_h * grid_w, 3 * temporal_patch * patch * patch] float32: per patch, in the
  /// order of merge windows (row-major windows of merge x merge patches, row-major inside),
  /// channels outermost, then the temporal copies, then the patch's rows and columns.
  at::Tensor pixel_values;
  std::array<int64_t, 3> grid_thw{0, 0, 0};  ///< patches along time, height, width
  /// The uint8 [h, w, 3] image that was normalized (after smart_resize's BICUBIC resize).
  at::Tensor resized;
};

/// Qwen2VLImageProcessor on one uint8 [H, W, 3] RGB image: BICUBIC resize (Pillow's) to
/// qwen2_vl_smart_resize's size, x * rescale_factor in float64 then float32, (x - mean) / std in
/// float32, the frame repeated to temporal_patch_size, patches flattened.
Qwen2VLImageInputs qwen2_vl_preprocess(const at::Tensor& pixels, const Qwen2VLImageProcessorConfig& config);

/// The same without the resize: `resized` must already have smart_resize's size (multiples of
/// patch_size * merge_size on both sides).
Qwen2VLImageInputs qwen2_vl_patchify(const at::Tensor& resized, const Qwen2VLImageProcessorConfig& config);

/// Images of a prompt side by side: pixel_values concatenated [sum N_i, P], grid_thw [n, 3] int64.
struct Qwen2VLBatchInputs {
  at::Tensor pixel_values;
  at::Tensor image_grid_thw;
};
Qwen2VLBatchInputs qwen2_vl_batch(const std::vector<Qwen2VLImageInputs>& images);

/// The tokens each image becomes after the vision tower's merger (grid_t * grid_h * grid_w /
/// merge_size²), what tokenizers::expand_image_pads takes.
std::vector<int64_t> qwen2_vl_image_token_counts(const std::vector<Qwen2VLImageInputs>& images, int64_t merge_size);

/// QwenImageEditPlusPipeline's condition area (384²) and VAE area (1024²).
constexpr int64_t kQwenImageEditConditionArea = 384 * 384;
constexpr int64_t kQwenImageEditVaeArea = 1024 * 1024;

/// diffusers' calculate_dimensions(target_area, ratio) of the Qwen-Image edit pipelines: width =
/// sqrt(area * ratio), height = width / ratio, each rounded (half to even) to a multiple of 32.
/// {width, height}, in that order as diffusers returns them.
std::pair<int64_t, int64_t> qwenimage_edit_calculate_dimensions(int64_t target_area, double ratio);

}  // namespace shardit::pipelines
