#include "shardit/io/image.h"

// jpeglib.h needs FILE and size_t declared first.
#include <cstddef>
#include <cstdio>

#include <jerror.h>
#include <jpeglib.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <csetjmp>
#include <cstdlib>
#include <cstring>

#include "shardit/io/file.h"
#include "shardit/io/png.h"

namespace shardit::io {

static_assert(kMaxInputImageSide == kMaxPngSide, "PNG and JPEG inputs share one size bound");

namespace {

constexpr char kPngSignature[] = "\x89PNG\r\n\x1a\n";

/// libjpeg's error manager, extended with the jump back into our decode and the message. Its
/// error_exit longjmps (the default calls exit()); no C++ object lives across the setjmp.
struct JpegErrors {
  jpeg_error_mgr manager;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void on_jpeg_error(j_common_ptr cinfo) {
  auto* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, errors->message);
  std::longjmp(errors->jump, 1);
}

/// Warnings are tolerated as Pillow tolerates them, except the end of the data before the
/// image's end: Pillow refuses a truncated JPEG ("image file is truncated").
void on_jpeg_message(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) on_jpeg_error(cinfo);
}

/// The decode's progress monitor, extended with its bounds: libjpeg calls it before each chunk
/// of input a multi-scan image absorbs and at every output row, where it stops a decode of more
/// than kMaxJpegScans scans or past the deadline (a jump back like an error's).
struct JpegProgress {
  jpeg_progress_mgr manager;
  const DecodeLimits* limits;
  bool too_many_scans = false;
  bool timed_out = false;
};

void on_jpeg_progress(j_common_ptr cinfo) {
  auto* progress = reinterpret_cast<JpegProgress*>(cinfo->progress);
  const auto* decompress = reinterpret_cast<j_decompress_ptr>(cinfo);
  progress->too_many_scans = decompress->input_scan_number > kMaxJpegScans;
  progress->timed_out =
      progress->limits->deadline && std::chrono::steady_clock::now() > *progress->limits->deadline;
  if (progress->too_many_scans || progress->timed_out) std::longjmp(reinterpret_cast<JpegErrors*>(cinfo->err)->jump, 1);
}

/// Pillow's MULDIV255: a * b / 255, rounded.
inline int muldiv255(int a, int b) {
  const int tmp = a * b + 128;
  return ((tmp >> 8) + tmp) >> 8;
}

/// libjpeg's part of a decode, with only plain locals across its setjmp; false on an error
/// (errors->message says why, or `limit_error` for a size out of bounds).
bool decode_jpeg_rows(jpeg_decompress_struct* cinfo, JpegErrors* errors, JpegProgress* progress,
                      const std::string* bytes, at::Tensor* pixels, std::pair<int64_t, int64_t>* size,
                      bool* out_of_bounds) {
  if (setjmp(errors->jump)) return false;
  jpeg_create_decompress(cinfo);
  cinfo->progress = &progress->manager;
  jpeg_mem_src(cinfo, reinterpret_cast<const unsigned char*>(bytes->data()), static_cast<unsigned long>(bytes->size()));
  jpeg_read_header(cinfo, TRUE);
  *size = {cinfo->image_height, cinfo->image_width};
  if (size->first > kMaxInputImageSide || size->second > kMaxInputImageSide || size->first == 0 ||
      size->second == 0) {
    *out_of_bounds = true;
    return false;
  }
  if (pixels == nullptr) return true;
  // As Pillow: YCbCr and RGB to RGB, grey replicated, CMYK (and YCCK, converted by libjpeg) kept
  // as CMYK and converted with Pillow's cmyk2rgb; an Adobe marker means inverted CMYK ("CMYK;I").
  const bool cmyk = cinfo->jpeg_color_space == JCS_CMYK || cinfo->jpeg_color_space == JCS_YCCK;
  const bool grey = cinfo->jpeg_color_space == JCS_GRAYSCALE;
  cinfo->out_color_space = cmyk ? JCS_CMYK : grey ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_start_decompress(cinfo);
  const JDIMENSION width = cinfo->output_width;
  const int components = cinfo->output_components;
  *pixels = at::empty({static_cast<int64_t>(cinfo->output_height), static_cast<int64_t>(width), 3}, at::kByte);
  uint8_t* data = pixels->data_ptr<uint8_t>();
  // A CMYK row is decoded into a scratch row libjpeg allocates (freed with the decompressor).
  JSAMPARRAY scratch =
      components == 4 ? (*cinfo->mem->alloc_sarray)(reinterpret_cast<j_common_ptr>(cinfo), JPOOL_IMAGE, width * 4, 1)
                      : nullptr;
  const bool inverted = cinfo->saw_Adobe_marker;
  while (cinfo->output_scanline < cinfo->output_height) {
    uint8_t* row = data + static_cast<size_t>(cinfo->output_scanline) * width * 3;
    if (components == 3) {
      JSAMPROW target = row;
      jpeg_read_scanlines(cinfo, &target, 1);
    } else if (components == 1) {
      JSAMPROW target = row + 2 * static_cast<size_t>(width);  // the row's last third, then spread
      jpeg_read_scanlines(cinfo, &target, 1);
      for (JDIMENSION x = 0; x < width; ++x) {
        const uint8_t value = row[2 * static_cast<size_t>(width) + x];
        row[3 * x] = row[3 * x + 1] = row[3 * x + 2] = value;
      }
    } else {
      jpeg_read_scanlines(cinfo, scratch, 1);
      const uint8_t* in = scratch[0];
      for (JDIMENSION x = 0; x < width; ++x, in += 4) {
        const int k = inverted ? 255 - in[3] : in[3];
        const int nk = 255 - k;
        for (int c = 0; c < 3; ++c) {
          const int value = inverted ? 255 - in[c] : in[c];
          row[3 * x + c] = static_cast<uint8_t>(std::clamp(nk - muldiv255(value, nk), 0, 255));
        }
      }
    }
  }
  jpeg_finish_decompress(cinfo);
  return true;
}

std::pair<int64_t, int64_t> decode_jpeg(const std::string& bytes, const std::string& what, at::Tensor* pixels,
                                        const DecodeLimits& limits) {
  jpeg_decompress_struct cinfo;
  JpegErrors errors;
  std::memset(&cinfo, 0, sizeof(cinfo));
  cinfo.err = jpeg_std_error(&errors.manager);
  errors.manager.error_exit = on_jpeg_error;
  errors.manager.emit_message = on_jpeg_message;
  errors.message[0] = '\0';
  JpegProgress progress{};
  progress.manager.progress_monitor = on_jpeg_progress;
  progress.limits = &limits;
  std::pair<int64_t, int64_t> size{0, 0};
  bool out_of_bounds = false;
  const bool ok = decode_jpeg_rows(&cinfo, &errors, &progress, &bytes, pixels, &size, &out_of_bounds);
  jpeg_destroy_decompress(&cinfo);
  TORCH_CHECK(!out_of_bounds, what, ": not a readable JPEG: it is ", size.second, "x", size.first,
              " pixels; at least 1 and at most ", kMaxInputImageSide, " per side are read");
  TORCH_CHECK(!progress.too_many_scans, what, ": a progressive JPEG of more than ", kMaxJpegScans,
              " scans (each a pass over the whole ", size.second, "x", size.first,
              " image); at most ", kMaxJpegScans, " are decoded: save it as a baseline JPEG or a PNG");
  TORCH_CHECK(!progress.timed_out, what, ": decoding the ", size.second, "x", size.first, " JPEG took longer than ",
              limits.deadline_words, "; it was stopped");
  TORCH_CHECK(ok, what, ": not a readable JPEG: ", errors.message);
  return size;
}

/// The format of `bytes`, or a named error for an empty file or another format.
std::string checked_format(const std::string& bytes, const std::string& what) {
  TORCH_CHECK(!bytes.empty(), what, ": the image is empty (0 bytes); expected a PNG or JPEG image");
  const std::string format = sniff_image_format(bytes.substr(0, 8));
  if (!format.empty()) return format;
  TORCH_CHECK(!(bytes.size() >= 12 && bytes.compare(0, 4, "RIFF") == 0 && bytes.compare(8, 4, "WEBP") == 0), what,
              ": a WebP image, which is not read here (no WebP decoder is built in); convert it to PNG or JPEG");
  // Say what it starts with: printable bytes as text, others as hex.
  std::string start;
  for (size_t i = 0; i < std::min<size_t>(bytes.size(), 8); ++i) {
    const unsigned char c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x20 && c < 0x7f) {
      start += static_cast<char>(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      start += hex;
    }
  }
  TORCH_CHECK(false, what, ": not a PNG or JPEG image (its ", bytes.size(), " bytes start with \"", start,
              "\", neither signature); give a .png or .jpg file");
  return "";
}

/// The image's size from its header, checked against limits.max_pixels; then, with `pixels`, the
/// image decoded into it under the limits.
std::pair<int64_t, int64_t> decode_any(const std::string& bytes, const std::string& what, at::Tensor* pixels,
                                       const DecodeLimits& limits) {
  const bool png = checked_format(bytes, what) == "png";
  const auto size = png ? decode_png(bytes, what, nullptr) : decode_jpeg(bytes, what, nullptr, limits);
  const int64_t area = size.first * size.second;
  TORCH_CHECK(area <= limits.max_pixels, what, ": the image is ", size.second, "x", size.first, " (", area,
              " pixels); at most ", limits.max_pixels, " pixels an image are decoded",
              limits.max_pixels_option.empty() ? "" : " (" + limits.max_pixels_option + ")",
              ": send a smaller image");
  if (pixels == nullptr) return size;
  return png ? decode_png(bytes, what, pixels, limits.deadline, limits.deadline_words)
             : decode_jpeg(bytes, what, pixels, limits);
}

/// libjpeg's part of an encode, with only plain locals across its setjmp; false on an error
/// (errors->message says why). `*out` is malloc'ed by libjpeg, freed by the caller.
bool encode_jpeg_rows(jpeg_compress_struct* cinfo, JpegErrors* errors, const at::Tensor* pixels, int quality,
                      unsigned char** out, unsigned long* out_size) {
  if (setjmp(errors->jump)) return false;
  jpeg_create_compress(cinfo);
  jpeg_mem_dest(cinfo, out, out_size);
  cinfo->image_height = static_cast<JDIMENSION>(pixels->size(0));
  cinfo->image_width = static_cast<JDIMENSION>(pixels->size(1));
  cinfo->input_components = 3;
  cinfo->in_color_space = JCS_RGB;
  jpeg_set_defaults(cinfo);
  jpeg_set_quality(cinfo, quality, TRUE);
  jpeg_start_compress(cinfo, TRUE);
  const auto* data = pixels->data_ptr<uint8_t>();
  const size_t row_bytes = static_cast<size_t>(cinfo->image_width) * 3;
  while (cinfo->next_scanline < cinfo->image_height) {
    auto* row = const_cast<JSAMPLE*>(data + cinfo->next_scanline * row_bytes);
    jpeg_write_scanlines(cinfo, &row, 1);
  }
  jpeg_finish_compress(cinfo);
  return true;
}

}  // namespace

std::string sniff_image_format(const std::string& head) {
  if (head.compare(0, 8, kPngSignature, 8) == 0 && head.size() >= 8) return "png";
  if (head.size() >= 3 && static_cast<unsigned char>(head[0]) == 0xFF && static_cast<unsigned char>(head[1]) == 0xD8 &&
      static_cast<unsigned char>(head[2]) == 0xFF) {
    return "jpeg";
  }
  return "";
}

at::Tensor decode_image(const std::string& bytes, const std::string& what, const DecodeLimits& limits) {
  at::Tensor pixels;
  decode_any(bytes, what, &pixels, limits);
  return pixels;
}

at::Tensor read_image(const std::string& path) {
  return decode_image(read_regular_file(path, static_cast<uint64_t>(kMaxInputImageFileBytes)), path, {});
}

std::pair<int64_t, int64_t> image_size(const std::string& bytes, const std::string& what, const DecodeLimits& limits) {
  return decode_any(bytes, what, nullptr, limits);
}

std::string encode_jpeg(const at::Tensor& pixels, int quality, const std::string& what) {
  TORCH_CHECK(pixels.dim() == 3 && pixels.size(2) == 3 && pixels.scalar_type() == at::kByte, what,
              ": a JPEG is written from uint8 [H, W, 3] pixels, got ", pixels.scalar_type(), " ", pixels.sizes());
  TORCH_CHECK(quality >= 0 && quality <= 100, what, ": JPEG quality must be between 0 and 100, got ", quality);
  const at::Tensor contiguous = pixels.contiguous();
  jpeg_compress_struct cinfo;
  JpegErrors errors;
  std::memset(&cinfo, 0, sizeof(cinfo));
  cinfo.err = jpeg_std_error(&errors.manager);
  errors.manager.error_exit = on_jpeg_error;
  errors.message[0] = '\0';
  unsigned char* out = nullptr;
  unsigned long out_size = 0;
  const bool ok = encode_jpeg_rows(&cinfo, &errors, &contiguous, quality, &out, &out_size);
  jpeg_destroy_compress(&cinfo);
  std::string bytes = ok && out ? std::string(reinterpret_cast<const char*>(out), out_size) : std::string();
  std::free(out);
  TORCH_CHECK(ok, what, ": writing the JPEG failed: ", errors.message);
  return bytes;
}

}  // namespace shardit::io
