#include "shardit/io/png.h"

#include <png.h>

#include <csetjmp>
#include <cstring>
#include <filesystem>

#include "shardit/io/file.h"

namespace shardit::io {

namespace {

bool is_ascii(const std::string& value) {
  for (const unsigned char c : value) {
    if (c >= 0x80) return false;
  }
  return true;
}

void append_to_string(png_structp png, png_bytep data, png_size_t size) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), size);
}

void flush_nothing(png_structp) {}

[[noreturn]] void on_png_error(png_structp png, png_const_charp message) {
  *static_cast<std::string*>(png_get_error_ptr(png)) = message;
  png_longjmp(png, 1);
}

void on_png_warning(png_structp, png_const_charp) {}

/// libpng's part of a write, with only plain locals across its setjmp; false on an error.
bool encode_rows(png_structp png, png_infop info, std::string* out, png_text* chunks, int num_chunks,
                 const uint8_t* data, png_uint_32 width, png_uint_32 height) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_write_fn(png, out, append_to_string, flush_nothing);
  png_set_IHDR(png, info, width, height, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (num_chunks > 0) png_set_text(png, info, chunks, num_chunks);
  png_write_info(png, info);
  for (png_uint_32 y = 0; y < height; ++y) {
    png_write_row(png, const_cast<png_bytep>(data + static_cast<size_t>(y) * width * 3));
  }
  png_write_end(png, info);
  return true;
}

/// The PNG bytes libpng reads from, and how far it has read.
struct PngSource {
  const std::string* bytes;
  size_t offset = 0;
  std::optional<std::chrono::steady_clock::time_point> deadline;
  bool timed_out = false;
};

/// Stops the decode (a png_error) once the source's deadline has passed.
void check_deadline(png_structp png, PngSource* source) {
  if (!source->deadline || std::chrono::steady_clock::now() <= *source->deadline) return;
  source->timed_out = true;
  png_error(png, "the decode deadline passed");
}

void read_from_source(png_structp png, png_bytep data, png_size_t size) {
  auto* source = static_cast<PngSource*>(png_get_io_ptr(png));
  check_deadline(png, source);
  if (source->bytes->size() - source->offset < size) {
    png_error(png, "the data ends early (a truncated file)");
  }
  std::memcpy(data, source->bytes->data() + source->offset, size);
  source->offset += size;
}

/// libpng's part of a read into `pixels`, allocated once the header's size is known and checked
/// (`pixels` null: the header only, its size in `size`). As Pillow's open + convert("RGB"):
/// palettes expanded (tRNS dropped), grey replicated, low bit depths scaled to 8 bits, alpha
/// dropped without compositing, 16-bit colour and grey+alpha samples cut to their high byte
/// (Pillow's "RGB;16B", "LA;16B" unpackers) and 16-bit grey clipped at 255 (Pillow opens it as
/// "I;16", whose conversion to RGB clips).
bool decode_png_rows(png_structp png, png_infop info, PngSource* source, at::Tensor* pixels,
                     std::pair<int64_t, int64_t>* size, std::string* error) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_read_fn(png, source, read_from_source);
  png_read_info(png, info);
  *size = {png_get_image_height(png, info), png_get_image_width(png, info)};
  // libpng refuses a side of 0 itself ("Image width is zero in IHDR").
  if (size->first > kMaxPngSide || size->second > kMaxPngSide) {
    // A small file can declare a huge image (2.6 MB of zeros decode to 30000x30000).
    *error = "it is " + std::to_string(size->second) + "x" + std::to_string(size->first) + " pixels; at most " +
             std::to_string(kMaxPngSide) + " per side are read";
    return false;
  }
  if (pixels == nullptr) return true;
  const int color_type = png_get_color_type(png, info);
  const bool grey16 = color_type == PNG_COLOR_TYPE_GRAY && png_get_bit_depth(png, info) == 16;
  if (!grey16) {
    png_set_expand(png);
    png_set_strip_16(png);  // the high byte (png_set_scale_16 would round)
    png_set_strip_alpha(png);
    png_set_gray_to_rgb(png);
  }
  const int passes = png_set_interlace_handling(png);
  png_read_update_info(png, info);
  const png_uint_32 height = png_get_image_height(png, info);
  const png_uint_32 width = png_get_image_width(png, info);
  const size_t row_bytes = png_get_rowbytes(png, info);
  TORCH_INTERNAL_ASSERT(row_bytes == static_cast<size_t>(width) * (grey16 ? 2 : 3));
  *pixels = at::empty({static_cast<int64_t>(height), static_cast<int64_t>(width), 3}, at::kByte);
  uint8_t* data = pixels->data_ptr<uint8_t>();
  // 16-bit grey rows go to the end of each pixel row (2 of its 3 bytes per pixel), then spread.
  // Row by row (no row-pointer array: only plain locals across the setjmp); an interlaced image
  // takes one sweep per pass, libpng merging each pass into the rows.
  const size_t offset = grey16 ? static_cast<size_t>(width) : 0;
  for (int pass = 0; pass < passes; ++pass) {
    for (png_uint_32 y = 0; y < height; ++y) {
      check_deadline(png, source);
      png_read_row(png, data + static_cast<size_t>(y) * width * 3 + offset, nullptr);
    }
  }
  png_read_end(png, nullptr);
  if (grey16) {
    for (png_uint_32 y = 0; y < height; ++y) {
      uint8_t* row = data + static_cast<size_t>(y) * width * 3;
      const uint8_t* samples = row + width;  // big-endian 16-bit samples
      for (png_uint_32 x = 0; x < width; ++x) {
        // Read before writing: pixel x's 3 bytes end at or before sample x's first byte.
        const uint8_t high = samples[2 * x];
        const uint8_t low = samples[2 * x + 1];
        const uint8_t value = high == 0 ? low : 255;
        row[3 * x] = row[3 * x + 1] = row[3 * x + 2] = value;
      }
    }
  }
  return true;
}

}  // namespace

at::Tensor to_uint8_pixels(const at::Tensor& image) {
  TORCH_CHECK(image.dim() == 3 && image.size(2) == 3, "image has shape ", image.sizes(), ", expected [H, W, 3]");
  // at::round rounds halves to even, as numpy does.
  return at::round(image.to(at::kFloat).clamp(0, 1) * 255).to(at::kByte).contiguous();
}

std::string encode_png(const at::Tensor& pixels, const std::vector<std::pair<std::string, std::string>>& text,
                       const std::string& what) {
  TORCH_CHECK(pixels.scalar_type() == at::kByte && pixels.dim() == 3 && pixels.size(2) == 3, what,
              ": pixels must be uint8 [H, W, 3], got ", pixels.scalar_type(), " ", pixels.sizes());
  const at::Tensor rows = pixels.contiguous();
  std::vector<png_text> chunks(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    png_text& chunk = chunks[i];
    const bool latin = is_ascii(text[i].second);
    chunk.compression = latin ? PNG_TEXT_COMPRESSION_NONE : PNG_ITXT_COMPRESSION_NONE;
    chunk.key = const_cast<char*>(text[i].first.c_str());
    chunk.text = const_cast<char*>(text[i].second.c_str());
    chunk.text_length = latin ? text[i].second.size() : 0;
    chunk.itxt_length = latin ? 0 : text[i].second.size();
    chunk.lang = nullptr;
    chunk.lang_key = nullptr;
  }
  std::string out;
  std::string error;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &error, on_png_error, on_png_warning);
  TORCH_CHECK(png != nullptr, what, ": libpng could not start a write");
  png_infop info = png_create_info_struct(png);
  const bool ok = info != nullptr &&
                  encode_rows(png, info, &out, chunks.data(), static_cast<int>(chunks.size()), rows.data_ptr<uint8_t>(),
                              static_cast<png_uint_32>(rows.size(1)), static_cast<png_uint_32>(rows.size(0)));
  png_destroy_write_struct(&png, &info);
  TORCH_CHECK(ok, what, ": writing the PNG failed: ", error);
  return out;
}

void write_png(const std::string& path, const at::Tensor& pixels,
               const std::vector<std::pair<std::string, std::string>>& text) {
  const std::string bytes = encode_png(pixels, text, path);
  AtomicFile file(path);
  file.write(bytes.data(), bytes.size());
  file.commit();
}

std::pair<int64_t, int64_t> decode_png(const std::string& bytes, const std::string& what, at::Tensor* pixels,
                                       std::optional<std::chrono::steady_clock::time_point> deadline,
                                       const std::string& deadline_words) {
  std::string error;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &error, on_png_error, on_png_warning);
  png_infop info = png != nullptr ? png_create_info_struct(png) : nullptr;
  std::pair<int64_t, int64_t> size{0, 0};
  PngSource source{&bytes, 0, deadline};
  const bool ok = info != nullptr && decode_png_rows(png, info, &source, pixels, &size, &error);
  png_destroy_read_struct(&png, &info, nullptr);
  TORCH_CHECK(!source.timed_out, what, ": decoding the ", size.second, "x", size.first,
              " PNG took longer than ", deadline_words, "; it was stopped");
  TORCH_CHECK(ok, what, ": not a readable PNG: ", error);
  return size;
}

at::Tensor read_png(const std::string& path) {
  at::Tensor pixels;
  decode_png(read_regular_file(path, kMaxPngFileBytes), path, &pixels);
  return pixels;
}

std::pair<int64_t, int64_t> png_size(const std::string& path) {
  return decode_png(read_regular_file(path, kMaxPngFileBytes), path, nullptr);
}

std::vector<std::string> image_paths(const std::string& out, int64_t count) {
  if (count == 1) return {out};
  const std::filesystem::path path(out);
  std::vector<std::string> paths;
  for (int64_t i = 0; i < count; ++i) {
    paths.push_back(
        (path.parent_path() / (path.stem().string() + "_" + std::to_string(i) + path.extension().string())).string());
  }
  return paths;
}

std::vector<std::string> save_images(const at::Tensor& image, const std::string& out,
                                     const std::vector<std::pair<std::string, std::string>>& text) {
  TORCH_CHECK(image.defined() && image.dim() == 4,
              "save_images: no decoded image on this rank (only ranks with a "
              "VAE decode; by default world rank 0)");
  const std::vector<std::string> paths = image_paths(out, image.size(0));
  for (size_t i = 0; i < paths.size(); ++i)
    write_png(paths[i], to_uint8_pixels(image[static_cast<int64_t>(i)]), text);
  return paths;
}

}  // namespace shardit::io
