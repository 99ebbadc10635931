// Every malformed safetensors file and checkpoint layout is refused with a message naming the file,
// the tensor and the problem.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <functional>

#include "shardit/io/safetensors.h"
#include "support/test_support.h"

namespace shardit::io {
namespace test_safetensors_errors {
namespace {

using ::testing::StartsWith;
using shardit::testing::error_of;

/// A file made of an 8-byte length, `header` and `data_size` zero bytes.
std::string write_raw(const std::string& dir, const std::string& header, uint64_t data_size,
                      std::optional<uint64_t> declared_length = std::nullopt) {
  const std::string path = dir + "/x.safetensors";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t length = declared_length.value_or(header.size());
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << header << std::string(data_size, '\0');
  return path;
}

/// Opens a file with `header` and a data section of `data_size` bytes; returns the error after
/// the "<path>: " that starts it.
std::string open_error(const std::string& header, uint64_t data_size) {
  const std::string dir = testing::make_temp_dir("st-bad");
  const std::string path = write_raw(dir, header, data_size);
  // The pure parser and open() agree.
  const std::string parsed = error_of([&] {
    SafetensorsFile::parse_header(path, header.data(), header.size(), data_size, nullptr);
  });
  const std::string opened = error_of([&] { SafetensorsFile::open(path); });
  EXPECT_EQ(parsed, opened);
  const std::string prefix = path + ": ";
  if (opened.compare(0, prefix.size(), prefix) != 0) {
    ADD_FAILURE() << "the error does not start with the file's path: " << opened;
    return opened;
  }
  return opened.substr(prefix.size());
}

TEST(SafetensorsErrors, TruncatedFile) {
  const std::string dir = testing::make_temp_dir("st-trunc");
  const std::string path = dir + "/x.safetensors";
  std::ofstream(path, std::ios::binary) << "abcde";
  EXPECT_EQ(error_of([&] { SafetensorsFile::open(path); }),
            path + ": file is 5 bytes, too short for a safetensors file (it starts with an 8-byte header length)");
}

TEST(SafetensorsErrors, HeaderLengthBeyondFile) {
  const std::string dir = testing::make_temp_dir("st-len");
  const std::string path = write_raw(dir, "{}", 0, 1000);
  EXPECT_EQ(error_of([&] { SafetensorsFile::open(path); }),
            path + ": header length 1000 exceeds the file size 10 (truncated file, or not a safetensors file)");
  // A length with the top bit set must not wrap around.
  const std::string huge = write_raw(dir, "{}", 0, ~uint64_t{0});
  EXPECT_EQ(error_of([&] { SafetensorsFile::open(huge); }),
            huge + ": header length 18446744073709551615 exceeds the file size 10 (truncated file, or not a "
                   "safetensors file)");
}

TEST(SafetensorsErrors, DataSectionTruncated) {
  EXPECT_EQ(open_error(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 12),
            "tensor 'w' has data_offsets [0, 16] beyond the data section of 12 bytes (truncated file?)");
}

TEST(SafetensorsErrors, BadJson) {
  // The cause in parentheses is nlohmann-json's own wording.
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", )", 0),
              StartsWith("header is not valid JSON ([json.exception.parse_error.101] parse error at line 1, "
                         "column 24: "));
  EXPECT_THAT(open_error("", 0),
              StartsWith("header is not valid JSON ([json.exception.parse_error.101] parse error at line 1, "
                         "column 1: "));
}

TEST(SafetensorsErrors, NonObjectHeader) {
  EXPECT_EQ(open_error("[1, 2]", 0),
            "header is a JSON array, expected an object mapping tensor names to {dtype, shape, data_offsets}");
  EXPECT_EQ(open_error(R"({"w": 3})", 0),
            "tensor 'w' is 3, expected an object with dtype, shape and data_offsets");
}

TEST(SafetensorsErrors, DuplicateTensorName) {
  EXPECT_EQ(open_error(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                       2),
            "header lists 'w' more than once; a JSON object may name a key only once");
}

TEST(SafetensorsErrors, UnknownDtype) {
  EXPECT_EQ(open_error(R"({"a.b":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})", 4),
            "tensor 'a.b': unknown dtype \"F31\" (known: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, "
            "F8_E4M3, F8_E5M2)");
  EXPECT_EQ(open_error(R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", 4),
            "tensor 'a' has \"dtype\" 7, expected a string such as \"F32\"");
}

TEST(SafetensorsErrors, NegativeOrNonIntegerDim) {
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F32","shape":[2,-3],"data_offsets":[0,0]}})", 0),
            "tensor 'a' has negative dimension -3 in shape [2,-3]");
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
            "tensor 'a' has shape entry 2.0, expected a non-negative integer");
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8),
            "tensor 'a' has \"shape\" \"2\", expected an array of non-negative integers");
}

TEST(SafetensorsErrors, WrongByteSize) {
  EXPECT_EQ(open_error(R"({"a.b":{"dtype":"F32","shape":[3,4],"data_offsets":[0,24]}})", 48),
            "tensor 'a.b' has data_offsets [0, 24] (24 bytes) but shape [3, 4] x F32 needs 48 bytes");
}

TEST(SafetensorsErrors, ByteSizeOverflow) {
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0),
            "tensor 'a' has shape [4294967296, 4294967296] x F64, whose byte size overflows 64 bits");
  // numel fits 64 bits unsigned but times 8 bytes does not.
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", 0),
            "tensor 'a' has shape [2305843009213693952] x F64, whose byte size overflows 64 bits");
}

TEST(SafetensorsErrors, OutOfRangeOffsets) {
  EXPECT_EQ(open_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})", 4),
            "tensor 'a' has data_offsets [3, 5] beyond the data section of 4 bytes (truncated file?)");
  EXPECT_EQ(open_error(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[3,1]}})", 4),
            "tensor 'a' has data_offsets [3, 1] with begin after end");
  EXPECT_EQ(open_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[-1,1]}})", 4),
            "tensor 'a' has \"data_offsets\" [-1,1], expected [begin, end] with two non-negative integers");
  EXPECT_EQ(open_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,1,2]}})", 4),
            "tensor 'a' has \"data_offsets\" [0,1,2], expected [begin, end] with two non-negative integers");
}

TEST(SafetensorsErrors, OverlappingRanges) {
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                       R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                       24),
            "tensors 'a' (data_offsets [0, 16]) and 'b' (data_offsets [8, 24]) overlap");
  // Identical ranges overlap too; empty tensors never do.
  EXPECT_EQ(open_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
                       4),
            "tensors 'a' (data_offsets [0, 4]) and 'b' (data_offsets [0, 4]) overlap");
  const std::string ok = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                         R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[2,2]}})";
  EXPECT_EQ(SafetensorsFile::parse_header("ok", ok.data(), ok.size(), 4, nullptr).size(), 2u);
}

TEST(SafetensorsErrors, HolesAndTrailingBytes) {
  // The format requires the tensors to tile the data section: no gap, nothing after the last one.
  EXPECT_EQ(open_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
                       10),
            "tensor 'b' (data_offsets [6, 10]) leaves bytes [4, 6) of the data section unowned after tensor "
            "'a'; the format allows no holes between tensors");
  EXPECT_EQ(open_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6),
            "tensor 'a' (data_offsets [2, 6]) leaves bytes [0, 2) of the data section unowned; the format "
            "allows no holes between tensors");
  EXPECT_EQ(open_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 7),
            "the data section is 7 bytes but its tensors end at byte 4; the 3 trailing bytes belong to no "
            "tensor (corrupt or concatenated file?)");
  EXPECT_EQ(open_error("{}", 1),
            "the data section is 1 bytes but its tensors end at byte 0; the 1 trailing bytes belong to no "
            "tensor (corrupt or concatenated file?)");
}

TEST(SafetensorsErrors, BadMetadata) {
  EXPECT_EQ(open_error(R"({"__metadata__":{"format":1}})", 0),
            "\"__metadata__\" entry 'format' is 1, expected a string");
  EXPECT_EQ(open_error(R"({"__metadata__":["pt"]})", 0),
            "\"__metadata__\" is [\"pt\"], expected an object mapping strings to strings");
}

TEST(SafetensorsErrors, MissingFields) {
  EXPECT_EQ(open_error(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4),
            "tensor 'a' has no \"dtype\"");
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4),
            "tensor 'a' has no \"shape\"");
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F32","shape":[1]}})", 4),
            "tensor 'a' has no \"data_offsets\"");
}

TEST(SafetensorsErrors, ReadErrorsNameTheTensor) {
  const std::string dir = testing::make_temp_dir("st-read-err");
  const std::string path = dir + "/w.safetensors";
  save_safetensors(path, {{"w", at::zeros({4, 6})}, {"s", at::scalar_tensor(1.0)}});
  const auto file = SafetensorsFile::open(path);
  EXPECT_EQ(error_of([&] { file->info("nope"); }), path + ": no tensor named 'nope' (the file has 2 tensors)");
  EXPECT_EQ(error_of([&] { file->read_slices("w", 1, {{2, 7}}); }),
            path + ": tensor 'w' of shape [4, 6]: range [2, 7) along dim 1 is out of bounds for size 6");
  EXPECT_EQ(error_of([&] { file->read_slices("w", 0, {{3, 2}}); }),
            path + ": tensor 'w' of shape [4, 6]: range [3, 2) along dim 0 is out of bounds for size 4");
  EXPECT_EQ(error_of([&] { file->read_slices("w", 2, {{0, 1}}); }),
            path + ": tensor 'w' has 2 dims; cannot slice along dim 2");
  EXPECT_EQ(error_of([&] { file->read_slices("s", 0, {{0, 1}}); }),
            path + ": tensor 's' is a scalar and cannot be sliced");
}

TEST(SafetensorsErrors, WriterRefusesBadInput) {
  const std::string dir = testing::make_temp_dir("st-write-err");
  EXPECT_EQ(error_of([&] {
              save_safetensors(dir + "/a.safetensors", {{"w", at::zeros({2})}, {"w", at::zeros({2})}});
            }),
            dir + "/a.safetensors: tensor 'w' is given twice");
  EXPECT_EQ(error_of([&] {
              save_safetensors(dir + "/a.safetensors", {{"c", at::zeros({2}, at::kComplexFloat)}});
            }),
            "LibTorch dtype ComplexFloat has no safetensors equivalent (supported: float64/32/16, bfloat16, "
            "int64/32/16/8, uint8, bool, float8)");
}

TEST(CheckpointErrors, IndexNamesMissingFile) {
  const std::string dir = testing::make_temp_dir("ckpt-missing");
  save_safetensors(dir + "/model-00001-of-00002.safetensors", {{"a", at::zeros({2})}});
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})";
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir); }),
            dir + "/model.safetensors.index.json: names 'model-00002-of-00002.safetensors' (for tensor 'b' and "
                  "maybe others) but " + dir + "/model-00002-of-00002.safetensors: no such file (it does not exist)");
}

TEST(CheckpointErrors, IndexedTensorAbsentFromItsFile) {
  const std::string dir = testing::make_temp_dir("ckpt-absent");
  save_safetensors(dir + "/model-1.safetensors", {{"a", at::zeros({2})}});
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"a": "model-1.safetensors", "ghost": "model-1.safetensors"}})";
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir); }),
            dir + "/model.safetensors.index.json: tensor 'ghost' is listed for model-1.safetensors but " + dir +
                "/model-1.safetensors does not contain it");
}

TEST(CheckpointErrors, SameTensorInTwoFiles) {
  const std::string dir = testing::make_temp_dir("ckpt-dup");
  save_safetensors(dir + "/model-1.safetensors", {{"a", at::zeros({2})}});
  save_safetensors(dir + "/model-2.safetensors", {{"a", at::zeros({2})}, {"b", at::zeros({1})}});
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})";
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir); }),
            dir + ": tensor 'a' is in two files: " + dir + "/model-1.safetensors and " + dir +
                "/model-2.safetensors");
}

TEST(CheckpointErrors, BadIndex) {
  const std::string dir = testing::make_temp_dir("ckpt-badindex");
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weights": {}})";
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir); }),
            dir + "/model.safetensors.index.json: expected an object with a \"weight_map\" object (tensor name -> "
                  "file)");
  std::ofstream(dir + "/model.safetensors.index.json", std::ios::trunc) << "{oops";
  // The cause in parentheses is nlohmann-json's own wording.
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }),
              StartsWith(dir + "/model.safetensors.index.json: invalid JSON ([json.exception.parse_error.101] "
                               "parse error at line 1, column 2: "));
}

TEST(CheckpointErrors, FolderWithoutWeights) {
  const std::string dir = testing::make_temp_dir("ckpt-none");
  const std::string none = dir + ": no weights found (expected diffusion_pytorch_model*.safetensors or "
                                 "model*.safetensors, or their .safetensors.index.json)";
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir); }), none);
  save_safetensors(dir + "/outputs.safetensors", {{"a", at::zeros({2})}});
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir); }), none + "; other safetensors files here: outputs.safetensors");
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir + "/nothing"); }), dir + "/nothing: no such file or directory");
}

TEST(CheckpointErrors, AmbiguousWeights) {
  const std::string dir = testing::make_temp_dir("ckpt-ambiguous");
  save_safetensors(dir + "/diffusion_pytorch_model.safetensors", {{"a", at::zeros({2})}});
  save_safetensors(dir + "/diffusion_pytorch_model.fp16.safetensors", {{"a", at::zeros({2}, at::kHalf)}});
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir); }),
            dir + ": ambiguous weights: several files (diffusion_pytorch_model.fp16.safetensors, "
                  "diffusion_pytorch_model.safetensors) and no .safetensors.index.json; add the index, or open "
                  "one file directly");
  std::ofstream(dir + "/diffusion_pytorch_model.safetensors.index.json") << R"({"weight_map": {}})";
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map": {}})";
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir); }),
            dir + ": ambiguous weights: several index files (diffusion_pytorch_model.safetensors.index.json, "
                  "model.safetensors.index.json); keep one, or open the index file directly");
}

TEST(CheckpointErrors, UnknownTensorNamesTheCheckpoint) {
  const std::string dir = testing::make_temp_dir("ckpt-unknown");
  save_safetensors(dir + "/model.safetensors", {{"a", at::zeros({2})}});
  const Checkpoint checkpoint = Checkpoint::open(dir);
  EXPECT_EQ(error_of([&] { checkpoint.read("b"); }), dir + ": checkpoint has no tensor named 'b' (it has 1 tensors)");
}

}  // namespace
}  // namespace test_safetensors_errors
}  // namespace shardit::io
