#pragma once
// PNG through libpng: output as 8-bit RGB images with text chunks (the generation parameters, as
// image tools read them); input of every PNG colour type and bit depth as 8-bit RGB.
#include <ATen/ATen.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardit::io {

/// An image in [0, 1] (float, [H, W, 3]) as 8-bit pixels: uint8(round(x * 255)), halves to even
/// (numpy_to_pil's rounding).
at::Tensor to_uint8_pixels(const at::Tensor& image);

/// Writes `pixels` (uint8 [H, W, 3]) to `path` as an 8-bit RGB PNG, all or nothing. Each entry of
/// `text` becomes a tEXt chunk (an iTXt chunk when the value is not Latin-1 text, e.g. a UTF-8
/// prompt). Errors name the path.
void write_png(const std::string& path, const at::Tensor& pixels,
               const std::vector<std::pair<std::string, std::string>>& text = {});

/// `pixels` (uint8 [H, W, 3]) encoded as an 8-bit RGB PNG in memory, with `text` chunks as
/// write_png writes them. `what` names the image in errors.
std::string encode_png(const at::Tensor& pixels, const std::vector<std::pair<std::string, std::string>>& text = {},
                       const std::string& what = "image");

/// The PNG files for `count` images: `out` for one; out_0.png, out_1.png ... (stem_i.ext) for several.
std::vector<std::string> image_paths(const std::string& out, int64_t count);

/// Writes each image of `image` (float32 [B, H, W, 3] in [0, 1], a pipeline's output) to
/// image_paths(out, B) as 8-bit PNG with `text` chunks; returns the paths.
std::vector<std::string> save_images(const at::Tensor& image, const std::string& out,
                                     const std::vector<std::pair<std::string, std::string>>& text = {});

/// The largest side a PNG may declare to be read: shardit writes none larger (the pipelines'
/// kMaxImageSide), and a small file can declare a huge image.
constexpr int64_t kMaxPngSide = 16384;

/// The largest PNG file read_png reads.
constexpr int64_t kMaxPngFileBytes = int64_t{512} << 20;

/// Decodes the PNG in `bytes` to uint8 [H, W, 3] in `*pixels` as Pillow's open + convert("RGB")
/// gives it (grey, grey+alpha, palette, tRNS, RGB(A), 1 to 16 bits, interlaced), and returns
/// {height, width}; with `pixels` null only the header is read. Errors say "<what>: not a
/// readable PNG: <why>" (truncated or corrupt data, a side of 0 or above kMaxPngSide, refused
/// from the header before anything is allocated). Past `deadline` (when set) the decode stops
/// with "<what>: decoding took longer than <deadline_words>".
std::pair<int64_t, int64_t> decode_png(const std::string& bytes, const std::string& what, at::Tensor* pixels,
                                       std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt,
                                       const std::string& deadline_words = "");

/// Reads a PNG file as uint8 [H, W, 3] (decode_png). Errors name the path.
at::Tensor read_png(const std::string& path);

/// {height, width} from the PNG's header (checked as read_png checks it), without decoding.
std::pair<int64_t, int64_t> png_size(const std::string& path);

}  // namespace shardit::io
