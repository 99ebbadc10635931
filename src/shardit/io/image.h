#pragma once
// Input images: PNG (libpng) and JPEG (libjpeg-turbo) files or bytes decoded to 8-bit RGB, as
// Pillow's Image.open(...).convert("RGB") gives them (grey replicated, palettes expanded, alpha
// dropped without compositing, 16-bit samples reduced to 8 bits). The declared size is checked
// against kMaxImageSide from the header, before any pixel buffer is allocated. Also JPEG output
// (the server's output_format "jpeg").
#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace shardit::io {

/// The largest side an input image may declare (a small file can declare a huge image).
constexpr int64_t kMaxInputImageSide = 16384;

/// The most scans a progressive JPEG may hold: each scan is a pass over the whole image, so a
/// small file of thousands of scans takes seconds to decode (libjpeg's own encoder writes 10 for
/// a colour image with jpeg_simple_progression, optimising encoders a few dozen).
constexpr int64_t kMaxJpegScans = 100;

/// Bounds on the work of decoding an image, checked from its header before any pixel is
/// allocated (the pixel budget), and while it decodes (the scans, the deadline).
struct DecodeLimits {
  /// The most pixels (width x height) an image may declare; the side bound kMaxInputImageSide
  /// holds as well.
  int64_t max_pixels = kMaxInputImageSide * kMaxInputImageSide;
  /// Words naming how to change max_pixels in its error ("serve --max-image-pixels"); may be empty.
  std::string max_pixels_option;
  /// The decode stops with an error past this time; none: no deadline.
  std::optional<std::chrono::steady_clock::time_point> deadline;
  /// Words naming the deadline in its error ("serve --decode-timeout 10 s").
  std::string deadline_words;
};

/// The format of an encoded image, from its first bytes ("png", "jpeg"), or "" when neither.
std::string sniff_image_format(const std::string& head);

/// Decodes a PNG or JPEG (by its signature, not its name) from `bytes` to uint8 [H, W, 3] RGB.
/// `what` names the image in errors (a path, "request field image[1]"): not an image, truncated
/// or corrupt data, a side of 0 or above kMaxInputImageSide, more pixels than limits.max_pixels,
/// a JPEG of more than kMaxJpegScans scans, a decode past limits.deadline.
at::Tensor decode_image(const std::string& bytes, const std::string& what = "image", const DecodeLimits& limits = {});

/// decode_image of a file's bytes, errors naming the path. The file is read only up to a bound
/// (kMaxInputImageFileBytes).
at::Tensor read_image(const std::string& path);

/// The largest input image file read_image reads.
constexpr int64_t kMaxInputImageFileBytes = int64_t{512} << 20;

/// {height, width} from the header of a PNG or JPEG in `bytes`, checked as decode_image checks
/// it (sides and limits.max_pixels), without decoding the pixels.
std::pair<int64_t, int64_t> image_size(const std::string& bytes, const std::string& what = "image",
                                       const DecodeLimits& limits = {});

/// `pixels` (uint8 [H, W, 3]) encoded as a baseline JPEG in memory at libjpeg's `quality` (0 to
/// 100, as Pillow's quality; 4:2:0 chroma subsampling, libjpeg's defaults). `what` names the
/// image in errors. PNG output is io/png.h's encode_png.
std::string encode_jpeg(const at::Tensor& pixels, int quality, const std::string& what = "image");

}  // namespace shardit::io
