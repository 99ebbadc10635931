#include "shardit/pipelines/image_processing_qwen2_vl.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>

#include "shardit/io/model_folder.h"
#include "shardit/pipelines/image_processor.h"

namespace shardit::pipelines {

namespace {

/// Python's round() of a float to an integer: half to even (nearbyint in the default rounding
/// mode).
int64_t round_half_even(double x) { return static_cast<int64_t>(std::nearbyint(x)); }

}  // namespace

Qwen2VLImageProcessorConfig Qwen2VLImageProcessorConfig::from_json(const nlohmann::json& json, const std::string& source) {
  const io::ConfigReader reader(json, source);
  Qwen2VLImageProcessorConfig config;
  constexpr int64_t kMaxPixels = int64_t{1} << 40;
  if (json.contains("size") && json.at("size").is_object()) {
    const io::ConfigReader size(json.at("size"), source + " (size)");
    config.min_pixels = size.integer("shortest_edge", config.min_pixels, 1, kMaxPixels);
    config.max_pixels = size.integer("longest_edge", config.max_pixels, 1, kMaxPixels);
  }
  config.min_pixels = reader.integer("min_pixels", config.min_pixels, 1, kMaxPixels);
  config.max_pixels = reader.integer("max_pixels", config.max_pixels, 1, kMaxPixels);
  reader.require(config.min_pixels <= config.max_pixels, "'min_pixels' ", config.min_pixels, " is above 'max_pixels' ",
                 config.max_pixels);
  config.patch_size = reader.integer("patch_size", config.patch_size, 1, 1024);
  config.temporal_patch_size = reader.integer("temporal_patch_size", config.temporal_patch_size, 1, 64);
  config.merge_size = reader.integer("merge_size", config.merge_size, 1, 64);
  config.do_resize = reader.boolean("do_resize", config.do_resize);
  config.do_rescale = reader.boolean("do_rescale", config.do_rescale);
  config.do_normalize = reader.boolean("do_normalize", config.do_normalize);
  config.rescale_factor = reader.number("rescale_factor", config.rescale_factor, 1e-12, 1e12);
  const int64_t resample = reader.integer("resample", 3, 0, 5);
  reader.require(resample == 3, "'resample' ", resample, " is not supported; Qwen2VLImageProcessor uses BICUBIC (3)");
  const auto triple = [&](const char* key, std::array<double, 3> fallback, double min) {
    const std::vector<double> values = reader.numbers(key, {fallback.begin(), fallback.end()}, min, 1e6, 3);
    reader.require(values.size() == 3, "'", key, "' must have 3 values (RGB), got ", values.size());
    return std::array<double, 3>{values[0], values[1], values[2]};
  };
  config.image_mean = triple("image_mean", config.image_mean, -1e6);
  config.image_std = triple("image_std", config.image_std, 1e-12);
  return config;
}

std::pair<int64_t, int64_t> qwen2_vl_smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                                  int64_t max_pixels) {
  TORCH_CHECK(height > 0 && width > 0, "smart_resize: the image has no pixels (", height, "x", width, ")");
  TORCH_CHECK(factor > 0, "smart_resize: factor must be positive, got ", factor);
  const auto h = static_cast<double>(height);
  const auto w = static_cast<double>(width);
  const double aspect = std::max(h, w) / std::min(h, w);
  if (aspect > 200.0) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.17g", aspect);
    TORCH_CHECK(false, "absolute aspect ratio must be smaller than 200, got ", text, " (image ", width, "x", height,
                ")");
  }
  const auto f = static_cast<double>(factor);
  int64_t h_bar = round_half_even(h / f) * factor;
  int64_t w_bar = round_half_even(w / f) * factor;
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(static_cast<double>(height * width) / static_cast<double>(max_pixels));
    h_bar = std::max(factor, static_cast<int64_t>(std::floor(h / beta / f)) * factor);
    w_bar = std::max(factor, static_cast<int64_t>(std::floor(w / beta / f)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / static_cast<double>(height * width));
    h_bar = static_cast<int64_t>(std::ceil(h * beta / f)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(w * beta / f)) * factor;
  }
  return {h_bar, w_bar};
}

Qwen2VLImageInputs qwen2_vl_patchify(const at::Tensor& resized, const Qwen2VLImageProcessorConfig& config) {
  TORCH_CHECK(resized.defined() && resized.scalar_type() == at::kByte && resized.dim() == 3 && resized.size(2) == 3,
              "Qwen2VLImageProcessor: pixels must be uint8 [H, W, 3] RGB, got ",
              resized.defined() ? resized.sizes() : c10::IntArrayRef{});
  const int64_t p = config.patch_size;
  const int64_t m = config.merge_size;
  const int64_t tp = config.temporal_patch_size;
  const int64_t height = resized.size(0);
  const int64_t width = resized.size(1);
  TORCH_CHECK(height % (p * m) == 0 && width % (p * m) == 0, "Qwen2VLImageProcessor: the image is ", width, "x",
              height, "; both sides must be multiples of patch_size * merge_size = ", p * m,
              " (resize it with qwen2_vl_smart_resize)");
  // to_numpy_array, then rescale: float64 x * factor, cast to float32. [3, H, W]
  at::Tensor image = resized.cpu().permute({2, 0, 1}).to(at::kDouble);
  if (config.do_rescale) image = image * config.rescale_factor;
  image = image.to(at::kFloat);
  if (config.do_normalize) {
    // normalize: (x - mean) / std with mean and std as float32, in float32.
    const at::Tensor mean = at::tensor(std::vector<double>(config.image_mean.begin(), config.image_mean.end()))
                                .to(at::kFloat)
                                .view({3, 1, 1});
    const at::Tensor std = at::tensor(std::vector<double>(config.image_std.begin(), config.image_std.end()))
                               .to(at::kFloat)
                               .view({3, 1, 1});
    image = (image - mean) / std;
  }
  const int64_t grid_h = height / p;
  const int64_t grid_w = width / p;
  // One frame repeated to the temporal patch: [tp, 3, H, W]
  const at::Tensor frames = image.unsqueeze(0).expand({tp, 3, height, width});
  // [grid_t=1, tp, C, gh/m, m, p, gw/m, m, p] -> (0, 3, 6, 4, 7, 2, 1, 5, 8)
  const at::Tensor patches = frames.reshape({1, tp, 3, grid_h / m, m, p, grid_w / m, m, p})
                                 .permute({0, 3, 6, 4, 7, 2, 1, 5, 8})
                                 .reshape({grid_h * grid_w, 3 * tp * p * p});
  Qwen2VLImageInputs out;
  out.pixel_values = patches.contiguous();
  out.grid_thw = {1, grid_h, grid_w};
  out.resized = resized;
  return out;
}

Qwen2VLImageInputs qwen2_vl_preprocess(const at::Tensor& pixels, const Qwen2VLImageProcessorConfig& config) {
  TORCH_CHECK(pixels.defined() && pixels.scalar_type() == at::kByte && pixels.dim() == 3 && pixels.size(2) == 3,
              "Qwen2VLImageProcessor: pixels must be uint8 [H, W, 3] RGB, got ",
              pixels.defined() ? pixels.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(config.do_resize, "Qwen2VLImageProcessor: do_resize false is not supported (the sides must be "
                                "multiples of patch_size * merge_size)");
  const auto [height, width] = qwen2_vl_smart_resize(pixels.size(0), pixels.size(1),
                                                     config.patch_size * config.merge_size, config.min_pixels,
                                                     config.max_pixels);
  // transformers' resize always goes through Image.resize (a copy when the size is unchanged).
  return qwen2_vl_patchify(resize_bicubic(pixels, height, width), config);
}

Qwen2VLBatchInputs qwen2_vl_batch(const std::vector<Qwen2VLImageInputs>& images) {
  TORCH_CHECK(!images.empty(), "qwen2_vl_batch: no images");
  std::vector<at::Tensor> values;
  std::vector<int64_t> grids;
  for (const Qwen2VLImageInputs& image : images) {
    values.push_back(image.pixel_values);
    grids.insert(grids.end(), image.grid_thw.begin(), image.grid_thw.end());
  }
  Qwen2VLBatchInputs out;
  out.pixel_values = at::cat(values, 0);
  out.image_grid_thw = at::tensor(grids, at::kLong).view({static_cast<int64_t>(images.size()), 3});
  return out;
}

std::vector<int64_t> qwen2_vl_image_token_counts(const std::vector<Qwen2VLImageInputs>& images, int64_t merge_size) {
  TORCH_CHECK(merge_size > 0, "qwen2_vl_image_token_counts: merge_size must be positive, got ", merge_size);
  std::vector<int64_t> counts;
  for (const Qwen2VLImageInputs& image : images) {
    const auto& g = image.grid_thw;
    counts.push_back(g[0] * g[1] * g[2] / (merge_size * merge_size));
  }
  return counts;
}

std::pair<int64_t, int64_t> qwenimage_edit_calculate_dimensions(int64_t target_area, double ratio) {
  TORCH_CHECK(target_area > 0 && std::isfinite(ratio) && ratio > 0, "calculate_dimensions: target area ", target_area,
              " and aspect ratio ", ratio, " must be positive");
  const double width = std::sqrt(static_cast<double>(target_area) * ratio);
  const double height = width / ratio;
  return {round_half_even(width / 32.0) * 32, round_half_even(height / 32.0) * 32};
}

}  // namespace shardit::pipelines
