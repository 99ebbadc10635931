#include "shardit/pipelines/image_processor.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <tuple>
#include <vector>

namespace shardit::pipelines {

namespace {

// Pillow's libImaging/Resample.c, 8 bits per channel.
constexpr int kPrecisionBits = 32 - 8 - 2;

/// A Pillow resampling filter: its kernel and support.
struct Filter {
  double (*kernel)(double);
  double support;
};

double sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= M_PI;
  return std::sin(x) / x;
}

double lanczos(double x) {
  // A truncated sinc.
  if (-3.0 <= x && x < 3.0) return sinc(x) * sinc(x / 3.0);
  return 0.0;
}

double bicubic(double x) {
  // Keys' cubic convolution with a = -0.5.
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

constexpr Filter kLanczos{lanczos, 3.0};
constexpr Filter kBicubic{bicubic, 2.0};

/// One pass's filter: for output position i, `size[i]` input positions from `first[i]` with
/// fixed-point weights `weights[i * ksize + k]` (Pillow's precompute_coeffs then
/// normalize_coeffs_8bpc, for the box [0, in_size)).
struct Coefficients {
  int64_t ksize = 0;
  std::vector<int64_t> first;
  std::vector<int64_t> size;
  std::vector<int32_t> weights;
};

Coefficients precompute_coeffs(int64_t in_size, int64_t out_size, const Filter& filter) {
  const double scale = static_cast<double>(static_cast<float>(in_size)) / static_cast<double>(out_size);
  const double filterscale = std::max(scale, 1.0);
  const double support = filter.support * filterscale;
  Coefficients c;
  c.ksize = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.size.resize(out_size);
  c.weights.assign(static_cast<size_t>(out_size * c.ksize), 0);
  std::vector<double> k(static_cast<size_t>(c.ksize));
  for (int64_t xx = 0; xx < out_size; ++xx) {
    const double center = (static_cast<double>(xx) + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    // Pillow rounds by truncating x + 0.5 (toward zero: -0.3 becomes 0, then 0 is the floor).
    const auto xmin = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    const int64_t xmax = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in_size) - xmin;
    double ww = 0.0;
    for (int64_t x = 0; x < xmax; ++x) {
      const double w = filter.kernel((static_cast<double>(x + xmin) - center + 0.5) * ss);
      k[x] = w;
      ww += w;
    }
    for (int64_t x = 0; x < xmax; ++x) {
      if (ww != 0.0) k[x] /= ww;
      const double scaled = k[x] * static_cast<double>(1 << kPrecisionBits);
      c.weights[xx * c.ksize + x] = static_cast<int32_t>(k[x] < 0 ? -0.5 + scaled : 0.5 + scaled);
    }
    c.first[xx] = xmin;
    c.size[xx] = xmax;
  }
  return c;
}

/// Pillow's clip8: the accumulator's integer part, clipped to [0, 255].
inline uint8_t clip8(int32_t value) {
  return static_cast<uint8_t>(std::clamp(value >> kPrecisionBits, 0, 255));
}

/// One separable pass along `axis` (0: rows = vertical, 1: columns = horizontal) of uint8
/// [H, W, 3] contiguous pixels.
at::Tensor resample_pass(const at::Tensor& in, int64_t out_size, int axis, const Filter& filter) {
  const int64_t height = in.size(0);
  const int64_t width = in.size(1);
  const int64_t in_size = axis == 0 ? height : width;
  const Coefficients c = precompute_coeffs(in_size, out_size, filter);
  const int64_t out_height = axis == 0 ? out_size : height;
  const int64_t out_width = axis == 0 ? width : out_size;
  at::Tensor out = at::empty({out_height, out_width, 3}, at::kByte);
  const uint8_t* src = in.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  // Input position p of line `line` (a row for the horizontal pass, a column for the vertical).
  const int64_t step = axis == 0 ? width * 3 : 3;
  const int64_t line_step = axis == 0 ? 3 : width * 3;
  const int64_t lines = axis == 0 ? width : height;
  for (int64_t line = 0; line < lines; ++line) {
    for (int64_t o = 0; o < out_size; ++o) {
      const int32_t* k = &c.weights[o * c.ksize];
      const uint8_t* base = src + line * line_step + c.first[o] * step;
      int32_t ss0 = 1 << (kPrecisionBits - 1);
      int32_t ss1 = ss0;
      int32_t ss2 = ss0;
      for (int64_t x = 0; x < c.size[o]; ++x) {
        const uint8_t* p = base + x * step;
        ss0 += p[0] * k[x];
        ss1 += p[1] * k[x];
        ss2 += p[2] * k[x];
      }
      uint8_t* q = axis == 0 ? dst + (o * out_width + line) * 3 : dst + (line * out_width + o) * 3;
      q[0] = clip8(ss0);
      q[1] = clip8(ss1);
      q[2] = clip8(ss2);
    }
  }
  return out;
}

void check_pixels(const at::Tensor& pixels, const char* what) {
  TORCH_CHECK(pixels.defined() && pixels.scalar_type() == at::kByte && pixels.dim() == 3 && pixels.size(2) == 3, what,
              ": pixels must be uint8 [H, W, 3] RGB, got ", pixels.defined() ? pixels.scalar_type() : at::kByte, " ",
              pixels.defined() ? pixels.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(pixels.size(0) > 0 && pixels.size(1) > 0, what, ": the image has no pixels (", pixels.sizes(), ")");
}

}  // namespace

namespace {

at::Tensor resize_with(const at::Tensor& pixels, int64_t height, int64_t width, const Filter& filter, const char* what) {
  check_pixels(pixels, what);
  TORCH_CHECK(height > 0 && width > 0, what, ": the target size must be positive, got ", height, "x", width);
  at::Tensor x = pixels.cpu().contiguous();
  // Image.resize returns a copy when the size does not change; otherwise Pillow runs one pass
  // per axis that changes, each rounding to 8 bits: the horizontal one first, except when the
  // width grows and the height shrinks (then the vertical one first, as Pillow 13 does; the
  // order changes pixels by a level or two). (Pillow restricts the first pass to the lines the
  // second one reads: the same numbers.)
  const bool vertical_first = width > x.size(1) && height < x.size(0);
  if (vertical_first) x = resample_pass(x, height, 0, filter);
  if (width != x.size(1)) x = resample_pass(x, width, 1, filter);
  if (height != x.size(0)) x = resample_pass(x, height, 0, filter);
  return x.is_same(pixels) ? x.clone() : x;
}

}  // namespace

at::Tensor resize_lanczos(const at::Tensor& pixels, int64_t height, int64_t width) {
  return resize_with(pixels, height, width, kLanczos, "resize_lanczos");
}

at::Tensor resize_bicubic(const at::Tensor& pixels, int64_t height, int64_t width) {
  return resize_with(pixels, height, width, kBicubic, "resize_bicubic");
}

void check_flux2_image_input(int64_t height, int64_t width) {
  constexpr int64_t kMinSide = 64;
  constexpr int64_t kMaxAspect = 8;
  const char* times = "\xC3\x97";  // U+00D7, as diffusers writes the size
  TORCH_CHECK(width >= kMinSide && height >= kMinSide, "Image too small: ", width, times, height,
              ". Both dimensions must be at least ", kMinSide, "px");
  const double aspect = std::max(static_cast<double>(width) / static_cast<double>(height),
                                 static_cast<double>(height) / static_cast<double>(width));
  if (aspect > static_cast<double>(kMaxAspect)) {
    char ratio[64];
    std::snprintf(ratio, sizeof(ratio), "%.1f", aspect);  // Python's {:.1f}: correctly rounded
    TORCH_CHECK(false, "Aspect ratio too extreme: ", width, times, height, " (ratio: ", ratio,
                ":1). Maximum allowed ratio is ", kMaxAspect, ":1");
  }
}

namespace {

/// The size _resize_to_target_area gives an image of `height` x `width`: unchanged up to a 1024²
/// area, else scaled to it with int() truncating the scaled sides. {height, width}.
std::pair<int64_t, int64_t> flux2_resized_size(int64_t height, int64_t width) {
  constexpr int64_t kTargetArea = 1024 * 1024;
  if (width * height <= kTargetArea) return {height, width};
  const double scale = std::sqrt(static_cast<double>(kTargetArea) / static_cast<double>(width * height));
  return {static_cast<int64_t>(static_cast<double>(height) * scale),
          static_cast<int64_t>(static_cast<double>(width) * scale)};
}

}  // namespace

std::pair<int64_t, int64_t> flux2_condition_size(int64_t height, int64_t width, int64_t multiple_of) {
  TORCH_CHECK(multiple_of > 0, "flux2_condition_size: multiple_of must be positive, got ", multiple_of);
  const auto [resized_height, resized_width] = flux2_resized_size(height, width);
  return {resized_height / multiple_of * multiple_of, resized_width / multiple_of * multiple_of};
}

at::Tensor flux2_condition_image(const at::Tensor& pixels, int64_t multiple_of) {
  check_pixels(pixels, "flux2_condition_image");
  check_flux2_image_input(pixels.size(0), pixels.size(1));
  const auto [height, width] = flux2_resized_size(pixels.size(0), pixels.size(1));
  const at::Tensor image =
      height == pixels.size(0) && width == pixels.size(1) ? pixels : resize_lanczos(pixels, height, width);
  const auto [crop_height, crop_width] = flux2_condition_size(pixels.size(0), pixels.size(1), multiple_of);
  // Flux2ImageProcessor._resize_and_crop: a centre crop, no resampling.
  const int64_t left = (width - crop_width) / 2;
  const int64_t top = (height - crop_height) / 2;
  return pixels_to_model_input(image.narrow(0, top, crop_height).narrow(1, left, crop_width));
}

const std::vector<std::pair<int64_t, int64_t>>& preferred_kontext_resolutions() {
  static const std::vector<std::pair<int64_t, int64_t>> resolutions = {
      {672, 1568}, {688, 1504}, {720, 1456}, {752, 1392},  {800, 1328},  {832, 1248},
      {880, 1184}, {944, 1104}, {1024, 1024}, {1104, 944}, {1184, 880},  {1248, 832},
      {1328, 800}, {1392, 752}, {1456, 720}, {1504, 688}, {1568, 672}};
  return resolutions;
}

std::pair<int64_t, int64_t> kontext_image_size(int64_t height, int64_t width, bool auto_resize,
                                               int64_t vae_scale_factor, int64_t multiple_of) {
  TORCH_CHECK(vae_scale_factor > 0 && multiple_of > 0, "kontext_image_size: vae_scale_factor (", vae_scale_factor,
              ") and multiple_of (", multiple_of, ") must be positive");
  // VaeImageProcessor.get_default_height_width, with the pipeline's processor factor (2 x the
  // VAE's).
  const int64_t processor_factor = 2 * vae_scale_factor;
  height -= height % processor_factor;
  width -= width % processor_factor;
  TORCH_CHECK(height > 0 && width > 0, "FluxKontextPipeline: the image is smaller than ", processor_factor,
              " pixels on a side; give an image of at least ", processor_factor, "x", processor_factor);
  if (auto_resize) {
    const double aspect = static_cast<double>(width) / static_cast<double>(height);
    std::tuple<double, int64_t, int64_t> best{INFINITY, 0, 0};
    for (const auto& [w, h] : preferred_kontext_resolutions()) {
      // min() over (|aspect - w / h|, w, h) tuples: ties go to the smaller width, then height.
      best = std::min(best, std::make_tuple(std::abs(aspect - static_cast<double>(w) / static_cast<double>(h)), w, h));
    }
    width = std::get<1>(best);
    height = std::get<2>(best);
  }
  width = width / multiple_of * multiple_of;
  height = height / multiple_of * multiple_of;
  return {height, width};
}

at::Tensor kontext_condition_image(const at::Tensor& pixels, int64_t height, int64_t width) {
  check_pixels(pixels, "kontext_condition_image");
  TORCH_CHECK(height > 0 && width > 0, "kontext_condition_image: the size must be positive, got ", height, "x", width);
  // VaeImageProcessor.resize (Image.resize, LANCZOS: a copy when the size is unchanged).
  return pixels_to_model_input(resize_lanczos(pixels, height, width));
}

at::Tensor pixels_to_model_input(const at::Tensor& pixels) {
  check_pixels(pixels, "pixels_to_model_input");
  // pil_to_numpy: float32 x / 255 (a true division, correctly rounded); normalize: 2 x - 1
  // (2 x is exact, so one rounding). A table of the 256 values, so that no kernel's
  // reciprocal-multiply can change a bit.
  static const at::Tensor table = [] {
    std::vector<float> values(256);
    for (int v = 0; v < 256; ++v) values[v] = 2.0f * (static_cast<float>(v) / 255.0f) - 1.0f;
    return at::tensor(values, at::kFloat);
  }();
  const at::Tensor indices = pixels.cpu().to(at::kLong).reshape({-1});
  const at::Tensor values = table.index_select(0, indices).view(pixels.sizes());
  return values.permute({2, 0, 1}).unsqueeze(0).contiguous();  // [1, 3, H, W]
}

}  // namespace shardit::pipelines
