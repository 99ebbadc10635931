// Input images (io/image.h): every PNG colour type and bit depth, and JPEG (RGB, grey, CMYK),
// decoded to 8-bit RGB as Pillow's open + convert("RGB") gives them; each written here with
// libpng / libjpeg. Then the bad inputs, each a named error: truncated data, a huge declared size
// (refused from the header, before allocating), a text file named .png, an empty file.
#include <gtest/gtest.h>

#include <jpeglib.h>
#include <png.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "shardit/io/image.h"
#include "shardit/io/png.h"
#include "support/test_support.h"

namespace shardit {
namespace test_image_input {
namespace {

using testing::error_of;

struct PngSpec {
  int width = 0;
  int height = 0;
  int color_type = PNG_COLOR_TYPE_RGB;
  int bit_depth = 8;
  bool interlaced = false;
  std::vector<png_color> palette;
  std::vector<png_byte> palette_alpha;  ///< tRNS of a palette image
  std::vector<std::vector<png_byte>> rows;  ///< packed rows as libpng takes them
};

PngSpec png_spec(int width, int height, int color_type, int bit_depth, bool interlaced = false) {
  PngSpec spec;
  spec.width = width;
  spec.height = height;
  spec.color_type = color_type;
  spec.bit_depth = bit_depth;
  spec.interlaced = interlaced;
  return spec;
}

void append(png_structp png, png_bytep data, png_size_t size) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), size);
}

void flush(png_structp) {}

/// A PNG written by libpng (errors end the test process: these specs are all valid).
std::string write_png_bytes(PngSpec spec) {
  std::string out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) std::abort();
  png_set_write_fn(png, &out, append, flush);
  png_set_IHDR(png, info, spec.width, spec.height, spec.bit_depth, spec.color_type,
               spec.interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!spec.palette.empty()) png_set_PLTE(png, info, spec.palette.data(), static_cast<int>(spec.palette.size()));
  if (!spec.palette_alpha.empty()) {
    png_set_tRNS(png, info, spec.palette_alpha.data(), static_cast<int>(spec.palette_alpha.size()), nullptr);
  }
  std::vector<png_bytep> rows;
  for (auto& row : spec.rows) rows.push_back(row.data());
  png_set_rows(png, info, rows.data());
  png_write_png(png, info, PNG_TRANSFORM_IDENTITY, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

/// A JPEG of `components` (1 grey, 3 RGB, 4 CMYK) interleaved samples, quality 100.
std::string write_jpeg_bytes(int width, int height, int components, const std::vector<uint8_t>& samples) {
  jpeg_compress_struct cinfo;
  jpeg_error_mgr errors;
  cinfo.err = jpeg_std_error(&errors);
  jpeg_create_compress(&cinfo);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = width;
  cinfo.image_height = height;
  cinfo.input_components = components;
  cinfo.in_color_space = components == 1 ? JCS_GRAYSCALE : components == 3 ? JCS_RGB : JCS_CMYK;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, 100, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(samples.data()) + static_cast<size_t>(cinfo.next_scanline) * width * components;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::string out(reinterpret_cast<const char*>(buffer), size);
  std::free(buffer);
  return out;
}

/// uint8 [H, W, 3] from interleaved RGB values.
at::Tensor rgb(int height, int width, const std::vector<int>& values) {
  std::vector<uint8_t> bytes(values.begin(), values.end());
  return at::tensor(at::ArrayRef<uint8_t>(bytes), at::kByte).view({height, width, 3}).clone();
}

void expect_pixels(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.scalar_type(), at::kByte) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::equal(actual, expected)) << what << "\nactual:\n" << actual << "\nexpected:\n" << expected;
}

TEST(ImageInput, GreyPngIsReplicated) {
  PngSpec spec = png_spec(2, 1, PNG_COLOR_TYPE_GRAY, 8);
  spec.rows = {{0, 200}};
  expect_pixels(io::decode_image(write_png_bytes(spec)), rgb(1, 2, {0, 0, 0, 200, 200, 200}), "grey");
}

TEST(ImageInput, LowBitDepthGreyPngIsScaledTo8Bits) {
  PngSpec one = png_spec(8, 1, PNG_COLOR_TYPE_GRAY, 1);
  one.rows = {{0b10100000}};
  expect_pixels(io::decode_image(write_png_bytes(one)),
                rgb(1, 8, {255, 255, 255, 0, 0, 0, 255, 255, 255, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}),
                "1-bit grey");
  PngSpec two = png_spec(4, 1, PNG_COLOR_TYPE_GRAY, 2);
  two.rows = {{0b00011011}};  // 0, 1, 2, 3 -> 0, 85, 170, 255
  expect_pixels(io::decode_image(write_png_bytes(two)),
                rgb(1, 4, {0, 0, 0, 85, 85, 85, 170, 170, 170, 255, 255, 255}), "2-bit grey");
}

TEST(ImageInput, GreyAlphaPngDropsAlphaWithoutCompositing) {
  PngSpec spec = png_spec(2, 1, PNG_COLOR_TYPE_GRAY_ALPHA, 8);
  spec.rows = {{10, 0, 250, 128}};
  expect_pixels(io::decode_image(write_png_bytes(spec)), rgb(1, 2, {10, 10, 10, 250, 250, 250}), "grey+alpha");
}

TEST(ImageInput, PalettePngWithTransparencyGivesThePaletteColours) {
  PngSpec spec = png_spec(3, 1, PNG_COLOR_TYPE_PALETTE, 8);
  spec.palette = {{255, 0, 0}, {0, 128, 255}, {7, 8, 9}};
  spec.palette_alpha = {0, 255, 100};
  spec.rows = {{2, 0, 1}};
  expect_pixels(io::decode_image(write_png_bytes(spec)), rgb(1, 3, {7, 8, 9, 255, 0, 0, 0, 128, 255}), "palette");
  PngSpec four_bit = png_spec(2, 1, PNG_COLOR_TYPE_PALETTE, 4);
  four_bit.palette = {{1, 2, 3}, {4, 5, 6}};
  four_bit.rows = {{0x10}};
  expect_pixels(io::decode_image(write_png_bytes(four_bit)), rgb(1, 2, {4, 5, 6, 1, 2, 3}), "4-bit palette");
}

TEST(ImageInput, RgbaPngDropsAlpha) {
  PngSpec spec = png_spec(2, 1, PNG_COLOR_TYPE_RGBA, 8);
  spec.rows = {{1, 2, 3, 0, 4, 5, 6, 255}};
  expect_pixels(io::decode_image(write_png_bytes(spec)), rgb(1, 2, {1, 2, 3, 4, 5, 6}), "RGBA");
}

TEST(ImageInput, SixteenBitPngsAsPillowConvertsThem) {
  // RGB and RGBA: the high byte of each big-endian sample (Pillow's "RGB;16B").
  PngSpec colour = png_spec(2, 1, PNG_COLOR_TYPE_RGB_ALPHA, 16);
  colour.rows = {{0x12, 0x34, 0xAB, 0xFF, 0x00, 0x80, 0, 0, 0xFF, 0xFF, 0x01, 0x00, 0x7F, 0xFF, 0x00, 0x00}};
  expect_pixels(io::decode_image(write_png_bytes(colour)), rgb(1, 2, {0x12, 0xAB, 0x00, 0xFF, 0x01, 0x7F}),
                "16-bit RGBA");
  // Grey: Pillow opens it as "I;16" and its RGB conversion clips at 255.
  PngSpec grey = png_spec(3, 1, PNG_COLOR_TYPE_GRAY, 16);
  grey.rows = {{0x00, 0x7B, 0x01, 0x00, 0xFF, 0xFF}};  // 123, 256, 65535
  expect_pixels(io::decode_image(write_png_bytes(grey)), rgb(1, 3, {123, 123, 123, 255, 255, 255, 255, 255, 255}),
                "16-bit grey");
}

TEST(ImageInput, InterlacedPngEqualsItsProgressiveTwin) {
  PngSpec spec = png_spec(11, 9, PNG_COLOR_TYPE_RGB, 8);
  for (int y = 0; y < spec.height; ++y) {
    std::vector<png_byte> row;
    for (int x = 0; x < spec.width * 3; ++x) row.push_back(static_cast<png_byte>((x * 37 + y * 91) % 256));
    spec.rows.push_back(row);
  }
  const at::Tensor plain = io::decode_image(write_png_bytes(spec));
  spec.interlaced = true;
  expect_pixels(io::decode_image(write_png_bytes(spec)), plain, "interlaced");
  EXPECT_EQ(plain[8][10][2].item<int>(), (32 * 37 + 8 * 91) % 256);
}

TEST(ImageInput, OneByOnePng) {
  PngSpec spec = png_spec(1, 1, PNG_COLOR_TYPE_RGB, 8);
  spec.rows = {{9, 8, 7}};
  const std::string bytes = write_png_bytes(spec);
  expect_pixels(io::decode_image(bytes), rgb(1, 1, {9, 8, 7}), "1x1");
  EXPECT_EQ(io::image_size(bytes), std::make_pair(int64_t{1}, int64_t{1}));
}

TEST(ImageInput, JpegRgbGreyAndCmyk) {
  // Flat colours survive JPEG at quality 100 within a level or two.
  std::vector<uint8_t> samples;
  for (int i = 0; i < 16 * 8; ++i) samples.insert(samples.end(), {200, 40, 90});
  const std::string rgb_bytes = write_jpeg_bytes(16, 8, 3, samples);
  EXPECT_EQ(io::sniff_image_format(rgb_bytes.substr(0, 8)), "jpeg");
  EXPECT_EQ(io::image_size(rgb_bytes), std::make_pair(int64_t{8}, int64_t{16}));
  const at::Tensor decoded = io::decode_image(rgb_bytes, "rgb.jpg");
  ASSERT_EQ(decoded.sizes(), (std::vector<int64_t>{8, 16, 3}));
  const at::Tensor expected = at::tensor({200, 40, 90}, at::kInt).view({1, 1, 3});
  EXPECT_LE((decoded.to(at::kInt) - expected).abs().max().item<int>(), 2);

  const std::string grey_bytes = write_jpeg_bytes(8, 8, 1, std::vector<uint8_t>(64, 77));
  const at::Tensor grey = io::decode_image(grey_bytes, "grey.jpg");
  ASSERT_EQ(grey.sizes(), (std::vector<int64_t>{8, 8, 3}));
  EXPECT_TRUE(at::equal(grey.select(2, 0), grey.select(2, 1)) && at::equal(grey.select(2, 0), grey.select(2, 2)));
  EXPECT_LE(std::abs(grey[3][3][0].item<int>() - 77), 1);

  // libjpeg marks CMYK with an Adobe marker: the samples are inverted (Photoshop's convention),
  // which Pillow undoes ("CMYK;I") before its cmyk2rgb. Inverted (0, 255, 255, 255) is C=255,
  // M=Y=K=0: cyan.
  std::vector<uint8_t> cmyk;
  for (int i = 0; i < 64; ++i) cmyk.insert(cmyk.end(), {0, 255, 255, 255});
  const at::Tensor cyan = io::decode_image(write_jpeg_bytes(8, 8, 4, cmyk), "cmyk.jpg");
  const at::Tensor expected_cyan = at::tensor({0, 255, 255}, at::kInt).view({1, 1, 3});
  EXPECT_LE((cyan.to(at::kInt) - expected_cyan).abs().max().item<int>(), 2) << cyan[0][0];
}

TEST(ImageInputErrors, TruncatedPngAndJpegAreNamed) {
  PngSpec spec = png_spec(16, 16, PNG_COLOR_TYPE_RGB, 8);
  for (int y = 0; y < 16; ++y) {
    std::vector<png_byte> row;
    for (int x = 0; x < 48; ++x) row.push_back(static_cast<png_byte>(x * y));
    spec.rows.push_back(row);
  }
  const std::string png = write_png_bytes(spec);
  std::string message = error_of([&] { io::decode_image(png.substr(0, png.size() / 2), "half.png"); });
  EXPECT_NE(message.find("half.png: not a readable PNG: the data ends early"), std::string::npos) << message;
  std::string corrupt = png;
  corrupt[corrupt.size() / 2] ^= 0x55;  // inside IDAT: its CRC no longer matches
  message = error_of([&] { io::decode_image(corrupt, "corrupt.png"); });
  EXPECT_NE(message.find("corrupt.png: not a readable PNG"), std::string::npos) << message;

  std::vector<uint8_t> samples(32 * 32 * 3);
  for (size_t i = 0; i < samples.size(); ++i) samples[i] = static_cast<uint8_t>(i * 7);
  const std::string jpeg = write_jpeg_bytes(32, 32, 3, samples);
  message = error_of([&] { io::decode_image(jpeg.substr(0, jpeg.size() / 2), "half.jpg"); });
  EXPECT_NE(message.find("half.jpg: not a readable JPEG"), std::string::npos) << message;
  message = error_of([&] { io::decode_image(jpeg.substr(0, 4), "stub.jpg"); });
  EXPECT_NE(message.find("stub.jpg: not a readable JPEG"), std::string::npos) << message;
}

TEST(ImageInputErrors, HugeDeclaredSizesAreRefusedFromTheHeader) {
  // A PNG header declaring 30000x30000 and no pixel data at all.
  PngSpec spec = png_spec(1, 1, PNG_COLOR_TYPE_RGB, 8);
  spec.rows = {{0, 0, 0}};
  std::string png = write_png_bytes(spec);
  // IHDR's width and height at bytes 16..23, then its CRC at 29..32.
  const unsigned char size[8] = {0, 0, 0x75, 0x30, 0, 0, 0x75, 0x30};
  std::memcpy(&png[16], size, 8);
  const uLong crc = crc32(crc32(0, nullptr, 0), reinterpret_cast<const Bytef*>(&png[12]), 17);
  for (int i = 0; i < 4; ++i) png[29 + i] = static_cast<char>((crc >> (24 - 8 * i)) & 0xFF);
  std::string message = error_of([&] { io::decode_image(png, "huge.png"); });
  EXPECT_NE(message.find("huge.png: not a readable PNG: it is 30000x30000 pixels; at most 16384 per side"),
            std::string::npos)
      << message;
  message = error_of([&] { io::image_size(png, "huge.png"); });
  EXPECT_NE(message.find("30000x30000"), std::string::npos) << message;

  // A JPEG whose SOF0 declares 30000x30000.
  std::string jpeg = write_jpeg_bytes(8, 8, 1, std::vector<uint8_t>(64, 1));
  const size_t sof = jpeg.find("\xFF\xC0");
  ASSERT_NE(sof, std::string::npos);
  const unsigned char dims[4] = {0x75, 0x30, 0x75, 0x30};
  std::memcpy(&jpeg[sof + 5], dims, 4);
  message = error_of([&] { io::decode_image(jpeg, "huge.jpg"); });
  EXPECT_NE(message.find("huge.jpg: not a readable JPEG: it is 30000x30000 pixels"), std::string::npos) << message;
}

TEST(ImageInputErrors, TextNamedPngAndEmptyFilesAreNamed) {
  const std::string dir = testing::make_temp_dir("image_input");
  const std::string text = dir + "/notes.png";
  std::ofstream(text) << "just some text, not an image\n";
  std::string message = error_of([&] { io::read_image(text); });
  EXPECT_NE(message.find(text + ": not a PNG or JPEG image (its 29 bytes start with \"just som\""), std::string::npos)
      << message;
  const std::string empty = dir + "/empty.jpg";
  std::ofstream(empty).flush();
  message = error_of([&] { io::read_image(empty); });
  EXPECT_NE(message.find(empty + ": the image is empty (0 bytes)"), std::string::npos) << message;
  message = error_of([&] { io::read_image(dir + "/missing.png"); });
  EXPECT_NE(message.find("missing.png"), std::string::npos) << message;
  EXPECT_EQ(io::sniff_image_format("GIF89a"), "");
  EXPECT_EQ(io::sniff_image_format(std::string("\x89PNG\r\n\x1a\n", 8)), "png");
}

TEST(ImageInput, ReadImageReadsAFile) {
  PngSpec spec = png_spec(2, 2, PNG_COLOR_TYPE_RGB, 8);
  spec.rows = {{1, 2, 3, 4, 5, 6}, {7, 8, 9, 10, 11, 12}};
  const std::string path = testing::make_temp_dir("image_input_file") + "/a.png";
  std::ofstream(path, std::ios::binary) << write_png_bytes(spec);
  expect_pixels(io::read_image(path), rgb(2, 2, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), "file");
  expect_pixels(io::read_png(path), rgb(2, 2, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), "read_png");
}

}  // namespace
}  // namespace test_image_input
}  // namespace shardit
