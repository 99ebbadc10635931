#include "shardit/io/png.h"

#include <png.h>

#include <csetjmp>
#include <cstdio>

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

/// libpng's part of a read into `pixels`, allocated once the header's size is known and checked
/// (`pixels` null: the header only, its size in `size`).
bool decode_png(png_structp png, png_infop info, FILE* stream, at::Tensor* pixels, std::pair<int64_t, int64_t>* size,
                std::string* error) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_init_io(png, stream);
  png_read_info(png, info);
  *size = {png_get_image_height(png, info), png_get_image_width(png, info)};
  if (size->first > kMaxPngSide || size->second > kMaxPngSide) {
    // A small file can declare a huge image (2.6 MB of zeros decode to 30000x30000).
    *error = "it is " + std::to_string(size->second) + "x" + std::to_string(size->first) +
             " pixels; at most " + std::to_string(kMaxPngSide) + " per side are read";
    return false;
  }
  if (pixels == nullptr) return true;
  png_set_expand(png);
  png_set_strip_16(png);
  png_set_strip_alpha(png);
  png_set_gray_to_rgb(png);
  png_read_update_info(png, info);
  const png_uint_32 height = png_get_image_height(png, info);
  const png_uint_32 width = png_get_image_width(png, info);
  *pixels = at::empty({static_cast<int64_t>(height), static_cast<int64_t>(width), 3}, at::kByte);
  uint8_t* data = pixels->data_ptr<uint8_t>();
  for (png_uint_32 y = 0; y < height; ++y) png_read_row(png, data + static_cast<size_t>(y) * width * 3, nullptr);
  png_read_end(png, nullptr);
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

namespace {

/// Reads `path`'s header, and its pixels unless `pixels` is null.
std::pair<int64_t, int64_t> read_png_file(const std::string& path, at::Tensor* pixels) {
  UniqueFd fd = open_regular_file(path);
  FILE* stream = ::fdopen(fd.get(), "rb");
  TORCH_CHECK(stream != nullptr, path, ": cannot be read");
  fd.release();
  std::string error;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &error, on_png_error, on_png_warning);
  png_infop info = png != nullptr ? png_create_info_struct(png) : nullptr;
  std::pair<int64_t, int64_t> size{0, 0};
  const bool ok = info != nullptr && decode_png(png, info, stream, pixels, &size, &error);
  png_destroy_read_struct(&png, &info, nullptr);
  std::fclose(stream);
  TORCH_CHECK(ok, path, ": not a readable PNG: ", error);
  return size;
}

}  // namespace

at::Tensor read_png(const std::string& path) {
  at::Tensor pixels;
  read_png_file(path, &pixels);
  return pixels;
}

std::pair<int64_t, int64_t> png_size(const std::string& path) { return read_png_file(path, nullptr); }

}  // namespace shardit::io
