// Every malformed GGUF file is refused with a message naming the file, the key or tensor, the sizes
// and what to do; the pure parser (what the fuzzer runs) and open() agree.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "shardit/io/gguf.h"
#include "shardit/nn/gguf_dequantize.h"
#include "shardit/nn/gguf_linear.h"
#include "support/gguf_bytes.h"
#include "support/test_support.h"

namespace shardit::io {
namespace test_gguf_errors {
namespace {

using ::testing::HasSubstr;
using shardit::testing::error_of;
using shardit::testing::GgufBytes;
using shardit::testing::gguf_string;
using shardit::testing::le_u32;
using shardit::testing::le_u64;

constexpr uint32_t kF32 = 0, kQ4_0 = 2, kQ4_K = 12;

/// The error of opening `file`, after the "<path>: " that must start it.
std::string open_error(const GgufBytes& file) {
  const std::string path = file.write(testing::make_temp_dir("gguf-bad") + "/x.gguf");
  const std::string bytes = file.build();
  const std::string parsed = error_of([&] {
    GgufFile::parse_header(path, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  });
  const std::string opened = error_of([&] { GgufFile::open(path); });
  EXPECT_EQ(parsed, opened);
  const std::string prefix = path + ": ";
  if (opened.compare(0, prefix.size(), prefix) != 0) {
    ADD_FAILURE() << "the error does not start with the file's path: " << opened;
    return opened;
  }
  return opened.substr(prefix.size());
}

GgufBytes one_f32(uint64_t offset = 0, uint64_t elements = 4) {
  GgufBytes file;
  file.tensor("w", {elements}, kF32, offset);
  file.data = std::string(offset + elements * 4, '\0');
  return file;
}

TEST(GgufErrors, TooShort) {
  GgufBytes file;
  file.magic = "GGU";
  file.alignment = 1;
  EXPECT_THAT(open_error(file), HasSubstr("too short for a GGUF file"));
}

TEST(GgufErrors, WrongMagic) {
  GgufBytes file;
  file.magic = "GGML";
  EXPECT_THAT(open_error(file), HasSubstr("does not start with \"GGUF\""));
}

TEST(GgufErrors, VersionOneAndUnknownVersions) {
  GgufBytes file;
  file.version = 1;
  EXPECT_THAT(open_error(file), HasSubstr("GGUF version 1 is not supported (versions 2 and 3 are"));
  file.version = 4;
  EXPECT_THAT(open_error(file), HasSubstr("GGUF version 4 is not supported"));
  file.version = 0x03000000;
  EXPECT_THAT(open_error(file), HasSubstr("big-endian GGUF file"));
}

TEST(GgufErrors, AbsurdTensorCount) {
  GgufBytes file;
  file.tensor_count = int64_t{1} << 60;
  EXPECT_THAT(open_error(file), HasSubstr("the header's tensor list declares 1152921504606846976 entries"));
}

TEST(GgufErrors, AbsurdMetadataCount) {
  GgufBytes file;
  file.metadata_count = 1000;
  EXPECT_THAT(open_error(file), HasSubstr("the header's metadata declares 1000 entries at byte 24, but the"));
}

TEST(GgufErrors, AbsurdStringLength) {
  GgufBytes file;
  file.kv("general.name", 8, le_u64(uint64_t{1} << 62) + "abc");
  EXPECT_THAT(open_error(file), HasSubstr("metadata 'general.name' (a string) is 4611686018427387904 bytes long"));
}

TEST(GgufErrors, AbsurdArrayCount) {
  GgufBytes file;
  file.kv("tokenizer.ids", 9, le_u32(4) + le_u64(uint64_t{1} << 61) + le_u32(7));
  EXPECT_THAT(open_error(file), HasSubstr("metadata 'tokenizer.ids' (an array of uint32) declares 2305843009213693952 entries"));
  GgufBytes strings;
  strings.kv("tokenizer.tokens", 9, le_u32(8) + le_u64(1000) + gguf_string("a"));
  EXPECT_THAT(open_error(strings), HasSubstr("metadata 'tokenizer.tokens' (an array of strings) declares 1000 entries"));
}

TEST(GgufErrors, NestedArraysTooDeep) {
  std::string value = le_u32(0) + le_u64(0);  // innermost: an empty array of uint8
  for (int i = 0; i < 9; ++i) value = le_u32(9) + le_u64(1) + value;
  GgufBytes file;
  file.kv("deep", 9, value);
  EXPECT_THAT(open_error(file), HasSubstr("nests arrays more than 8 deep"));
}

TEST(GgufErrors, UnknownValueType) {
  GgufBytes file;
  file.kv("k", 13, le_u32(0));
  EXPECT_THAT(open_error(file), HasSubstr("metadata 'k' (its type) is 13, not a GGUF value type"));
}

TEST(GgufErrors, DuplicateKey) {
  GgufBytes file;
  file.kv_u32("general.alignment", 32).kv_u32("general.alignment", 32);
  EXPECT_THAT(open_error(file), HasSubstr("metadata key \"general.alignment\" appears twice"));
}

TEST(GgufErrors, TruncatedMetadataValue) {
  GgufBytes file;
  file.kv("k", 10, le_u32(1));  // a uint64 with 4 bytes
  file.alignment = 1;
  EXPECT_THAT(open_error(file), HasSubstr("metadata 'k' needs 8 bytes at byte"));
}

TEST(GgufErrors, BadAlignment) {
  GgufBytes file = one_f32();
  file.kv_u32("general.alignment", 48);
  EXPECT_THAT(open_error(file), HasSubstr("metadata 'general.alignment' is 48, expected a power of two"));
  GgufBytes wrong_type = one_f32();
  wrong_type.kv("general.alignment", 10, le_u64(32));
  EXPECT_THAT(open_error(wrong_type), HasSubstr("'general.alignment' is uint64 32, expected a uint32"));
}

TEST(GgufErrors, DuplicateTensorName) {
  GgufBytes file;
  file.tensor("blocks.0.w", {4}, kF32, 0).tensor("blocks.0.w", {4}, kF32, 32);
  file.data = std::string(64, '\0');
  EXPECT_THAT(open_error(file), HasSubstr("tensor \"blocks.0.w\" appears twice in the header"));
}

TEST(GgufErrors, UnknownTensorType) {
  GgufBytes file;
  file.tensor("w", {4}, 99, 0);
  file.data = std::string(32, '\0');
  EXPECT_THAT(open_error(file), HasSubstr("tensor \"w\" has ggml type 99, which this reader does not know"));
}

TEST(GgufErrors, RowNotWholeBlocks) {
  GgufBytes file;
  file.tensor("q", {48, 2}, kQ4_0, 0);
  file.data = std::string(64, '\0');
  EXPECT_EQ(open_error(file), "tensor \"q\" (Q4_0, LibTorch shape [2, 48]) has rows of 48 elements, not a multiple of "
                              "Q4_0's block of 32 elements (corrupt file: a ggml row holds whole blocks)");
}

TEST(GgufErrors, TooManyDimensions) {
  GgufBytes file;
  file.tensor("w", {4, 1, 1, 1, 1}, kF32, 0);
  EXPECT_THAT(open_error(file), HasSubstr("tensor \"w\" has 5 dimensions; GGUF tensors have 1 to 4"));
  GgufBytes none;
  none.tensor("w", {}, kF32, 0);
  EXPECT_THAT(open_error(none), HasSubstr("tensor \"w\" has 0 dimensions"));
}

TEST(GgufErrors, SizeOverflow) {
  GgufBytes file;
  file.tensor("w", {uint64_t{1} << 40, uint64_t{1} << 40}, kF32, 0);
  EXPECT_THAT(open_error(file), HasSubstr("whose element count overflows int64"));
  GgufBytes bytes;
  bytes.tensor("w", {uint64_t{1} << 61, 1}, kF32, 0);
  EXPECT_THAT(open_error(bytes), HasSubstr("has a byte size that overflows int64"));
  GgufBytes dim;
  dim.tensor("w", {~uint64_t{0}}, kF32, 0);
  EXPECT_THAT(open_error(dim), HasSubstr("has dimension 0 of 18446744073709551615, beyond int64"));
}

TEST(GgufErrors, TensorPastTheEnd) {
  GgufBytes file = one_f32();
  file.data.resize(12);
  EXPECT_EQ(open_error(file), "tensor \"w\" (F32, dimensions [4], 16 bytes at offset 0) ends past the end of the "
                              "file, whose data section holds 12 bytes (truncated download; fetch the file again)");
  GgufBytes far;
  far.tensor("w", {4}, kF32, uint64_t{1} << 63);
  EXPECT_THAT(open_error(far), HasSubstr("ends past the end of the file"));
  GgufBytes quantized;
  quantized.tensor("q", {256, 3}, kQ4_K, 0);
  quantized.data = std::string(2 * 144, '\0');
  EXPECT_THAT(open_error(quantized), HasSubstr("tensor \"q\" (Q4_K, dimensions [256, 3], 432 bytes at offset 0)"));
}

TEST(GgufErrors, DataSectionPastTheEnd) {
  GgufBytes file = one_f32();
  file.data.clear();
  file.alignment = 1;  // the header is not padded: the data section would start past the end
  const std::string header = file.header();
  EXPECT_THAT(open_error(file), HasSubstr("the data section starts at byte " +
                                          std::to_string((header.size() + 31) / 32 * 32)));
}

TEST(GgufErrors, MisalignedOffset) {
  GgufBytes file = one_f32(20);
  EXPECT_THAT(open_error(file), HasSubstr("tensor \"w\" starts at offset 20 of the data section, not a multiple "
                                          "of the file's alignment of 32 bytes"));
}

TEST(GgufErrors, OverlappingTensors) {
  GgufBytes file;
  file.tensor("a", {16}, kF32, 0).tensor("b", {16}, kF32, 32);
  file.data = std::string(96, '\0');
  EXPECT_EQ(open_error(file), "tensors \"a\" (bytes [0, 64) of the data section) and \"b\" (bytes [32, 96)) overlap "
                              "(corrupt or hand-edited file)");
}

TEST(GgufErrors, ControlCharactersInNames) {
  GgufBytes file;
  file.tensor("a\x1b[31m", {4}, kF32, 0);
  file.data = std::string(16, '\0');
  EXPECT_THAT(open_error(file), HasSubstr("which is empty or holds control characters"));
}

TEST(GgufErrors, ReadsOutOfRangeAndUnsupportedTypes) {
  GgufBytes file;
  file.tensor("q", {64, 3}, kQ4_0, 0).tensor("iq", {256}, 16, 128);
  file.data = std::string(128 + 66, '\0');
  const std::string path = file.write(testing::make_temp_dir("gguf-range") + "/x.gguf");
  const auto gguf = GgufFile::open(path);
  EXPECT_EQ(error_of([&] { gguf->read_rows("q", {2, 4}); }),
            path + ": tensor \"q\" (Q4_0, LibTorch shape [3, 64]) has 3 rows; [2, 4) is out of range");
  EXPECT_EQ(error_of([&] { gguf->read_row_blocks("q", {0, 3}, {1, 3}); }),
            path + ": tensor \"q\" (Q4_0, LibTorch shape [3, 64]) has 2 blocks in each row; [1, 3) is out of range");
  EXPECT_THAT(error_of([&] { gguf->info("missing"); }), HasSubstr("no tensor named \"missing\" (the file has 2 tensors)"));
  EXPECT_THAT(error_of([&] { nn::gguf_dequantize(gguf->view("iq"), GgmlType::IQ2_XXS, at::kFloat, "tensor 'iq'"); }),
              HasSubstr("tensor 'iq' is stored as ggml type IQ2_XXS, which shardit does not dequantize (supported: "
                        "F32, F16, BF16, Q4_0"));
}


TEST(GgufErrors, NonFiniteScalesAreRefusedOnLoad) {
  // Q8_0 [4, 64] (2 blocks a row): block 1 of row 2 has d = NaN, block 0 of row 3 d = +inf.
  GgufBytes file;
  file.tensor("w", {64, 4}, 8, 0);
  for (int r = 0; r < 4; ++r) {
    for (int b = 0; b < 2; ++b) {
      const uint16_t d = r == 2 && b == 1 ? 0x7e00 : (r == 3 && b == 0 ? 0x7c00 : 0x3c00);
      file.data += std::string(reinterpret_cast<const char*>(&d), 2) + std::string(32, '\1');
    }
  }
  const std::string path = file.write(testing::make_temp_dir("gguf-nan") + "/x.gguf");
  const auto gguf = GgufFile::open(path);  // the header is valid: values are checked where they are read
  nn::Linear linear(nn::LinearOptions(64, 4).with_bias(false));
  EXPECT_EQ(error_of([&] { nn::load_gguf_linear(linear, *gguf, "w", nn::LinearParallel::None, 1, 0, at::kFloat); }),
            path + ": tensor 'w' (Q8_0) has a non-finite scale (nan) in block 1 of row 2 (blocks read with one: 2); "
                   "the file is corrupt (download it again, or quantize it again)");
  // Each rank checks its own share, and names the block in the whole tensor.
  EXPECT_THAT(error_of([&] { nn::load_gguf_linear(linear, *gguf, "w", nn::LinearParallel::Colwise, 2, 1, at::kFloat); }),
              HasSubstr("in block 1 of row 2 (blocks read with one: 2)"));
  nn::Linear rowwise(nn::LinearOptions(64, 4).with_bias(false));
  EXPECT_THAT(error_of([&] { nn::load_gguf_linear(rowwise, *gguf, "w", nn::LinearParallel::Rowwise, 2, 0, at::kFloat); }),
              HasSubstr("non-finite scale (inf) in block 0 of row 3 (blocks read with one: 1)"));
  EXPECT_NO_THROW(nn::load_gguf_linear(linear, *gguf, "w", nn::LinearParallel::Colwise, 2, 0, at::kFloat));
}


TEST(GgufErrors, FileTruncatedWhileOpenGivesAnErrorOnRead) {
  GgufBytes file = one_f32(0, 64);
  const std::string path = file.write(testing::make_temp_dir("gguf-shrunk") + "/x.gguf");
  const auto gguf = GgufFile::open(path);
  std::filesystem::resize_file(path, 80);  // the data section now ends inside "w"
  EXPECT_THAT(error_of([&] { gguf->read_rows("w", {0, 1}); }),
              HasSubstr(path + ": reading tensor 'w' failed at byte 80: unexpected end of file (was it truncated?)"));
}

}  // namespace
}  // namespace test_gguf_errors
}  // namespace shardit::io
