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
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
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

/// Opens a file with `header` and a data section of `data_size` bytes; returns the error.
std::string open_error(const std::string& header, uint64_t data_size) {
  const std::string dir = testing::make_temp_dir("st-bad");
  const std::string path = write_raw(dir, header, data_size);
  // The pure parser and open() agree.
  const std::string parsed = error_of([&] {
    SafetensorsFile::parse_header(path, header.data(), header.size(), data_size, nullptr);
  });
  const std::string opened = error_of([&] { SafetensorsFile::open(path); });
  EXPECT_EQ(parsed, opened);
  EXPECT_THAT(opened, HasSubstr(path));
  return opened;
}

TEST(SafetensorsErrors, TruncatedFile) {
  const std::string dir = testing::make_temp_dir("st-trunc");
  const std::string path = dir + "/x.safetensors";
  std::ofstream(path, std::ios::binary) << "abcde";
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(path); }),
              AllOf(HasSubstr(path), HasSubstr("file is 5 bytes, too short for a safetensors file")));
}

TEST(SafetensorsErrors, HeaderLengthBeyondFile) {
  const std::string dir = testing::make_temp_dir("st-len");
  const std::string path = write_raw(dir, "{}", 0, 1000);
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(path); }),
              AllOf(HasSubstr(path), HasSubstr("header length 1000 exceeds the file size 10")));
  // A length with the top bit set must not wrap around.
  const std::string huge = write_raw(dir, "{}", 0, ~uint64_t{0});
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(huge); }), HasSubstr("exceeds the file size"));
}

TEST(SafetensorsErrors, DataSectionTruncated) {
  EXPECT_THAT(open_error(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 12),
              HasSubstr("tensor 'w' has data_offsets [0, 16] beyond the data section of 12 bytes"));
}

TEST(SafetensorsErrors, BadJson) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", )", 0), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(open_error("", 0), HasSubstr("header is not valid JSON"));
}

TEST(SafetensorsErrors, NonObjectHeader) {
  EXPECT_THAT(open_error("[1, 2]", 0), HasSubstr("header is a JSON array, expected an object"));
  EXPECT_THAT(open_error(R"({"w": 3})", 0),
              HasSubstr("tensor 'w' is 3, expected an object with dtype, shape and data_offsets"));
}

TEST(SafetensorsErrors, DuplicateTensorName) {
  EXPECT_THAT(open_error(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                         R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                         2),
              HasSubstr("header lists 'w' more than once"));
}

TEST(SafetensorsErrors, UnknownDtype) {
  EXPECT_THAT(open_error(R"({"a.b":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})", 4),
              AllOf(HasSubstr("tensor 'a.b': unknown dtype \"F31\""), HasSubstr("known: F64, F32")));
  EXPECT_THAT(open_error(R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", 4),
              HasSubstr("tensor 'a' has \"dtype\" 7, expected a string"));
}

TEST(SafetensorsErrors, NegativeOrNonIntegerDim) {
  EXPECT_THAT(open_error(R"({"a":{"dtype":"F32","shape":[2,-3],"data_offsets":[0,0]}})", 0),
              HasSubstr("tensor 'a' has negative dimension -3 in shape [2,-3]"));
  EXPECT_THAT(open_error(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
              HasSubstr("tensor 'a' has shape entry 2.0, expected a non-negative integer"));
  EXPECT_THAT(open_error(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8),
              HasSubstr("tensor 'a' has \"shape\" \"2\", expected an array"));
}

TEST(SafetensorsErrors, WrongByteSize) {
  EXPECT_THAT(open_error(R"({"a.b":{"dtype":"F32","shape":[3,4],"data_offsets":[0,24]}})", 48),
              HasSubstr("tensor 'a.b' has data_offsets [0, 24] (24 bytes) but shape [3, 4] x F32 "
                        "needs 48 bytes"));
}

TEST(SafetensorsErrors, ByteSizeOverflow) {
  EXPECT_THAT(open_error(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0),
              HasSubstr("tensor 'a' has shape [4294967296, 4294967296] x F64, whose byte size overflows"));
  // numel fits 64 bits unsigned but times 8 bytes does not.
  EXPECT_THAT(open_error(R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", 0),
              HasSubstr("overflows 64 bits"));
}

TEST(SafetensorsErrors, OutOfRangeOffsets) {
  EXPECT_THAT(open_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})", 4),
              HasSubstr("tensor 'a' has data_offsets [3, 5] beyond the data section of 4 bytes"));
  EXPECT_THAT(open_error(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[3,1]}})", 4),
              HasSubstr("tensor 'a' has data_offsets [3, 1] with begin after end"));
  EXPECT_THAT(open_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[-1,1]}})", 4),
              HasSubstr("tensor 'a' has \"data_offsets\" [-1,1], expected [begin, end]"));
  EXPECT_THAT(open_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,1,2]}})", 4),
              HasSubstr("expected [begin, end] with two non-negative integers"));
}

TEST(SafetensorsErrors, OverlappingRanges) {
  EXPECT_THAT(open_error(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                         R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                         24),
              HasSubstr("tensors 'a' (data_offsets [0, 16]) and 'b' (data_offsets [8, 24]) overlap"));
  // Identical ranges overlap too; empty tensors never do.
  EXPECT_THAT(open_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
                         4),
              HasSubstr("overlap"));
  const std::string ok = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                         R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[2,2]}})";
  EXPECT_EQ(SafetensorsFile::parse_header("ok", ok.data(), ok.size(), 4, nullptr).size(), 2u);
}

TEST(SafetensorsErrors, HolesAndTrailingBytes) {
  // The format requires the tensors to tile the data section: no gap, nothing after the last one.
  EXPECT_THAT(open_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
                         10),
              HasSubstr("tensor 'b' (data_offsets [6, 10]) leaves bytes [4, 6) of the data section "
                        "unowned after tensor 'a'"));
  EXPECT_THAT(open_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6),
              HasSubstr("tensor 'a' (data_offsets [2, 6]) leaves bytes [0, 2) of the data section unowned"));
  EXPECT_THAT(open_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 7),
              HasSubstr("the data section is 7 bytes but its tensors end at byte 4; the 3 trailing bytes"));
  EXPECT_THAT(open_error("{}", 1), HasSubstr("the data section is 1 bytes but its tensors end at byte 0"));
}

TEST(SafetensorsErrors, BadMetadata) {
  EXPECT_THAT(open_error(R"({"__metadata__":{"format":1}})", 0),
              HasSubstr("\"__metadata__\" entry 'format' is 1, expected a string"));
  EXPECT_THAT(open_error(R"({"__metadata__":["pt"]})", 0),
              HasSubstr("\"__metadata__\" is [\"pt\"], expected an object mapping strings to strings"));
}

TEST(SafetensorsErrors, MissingFields) {
  EXPECT_THAT(open_error(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4),
              HasSubstr("tensor 'a' has no \"dtype\""));
  EXPECT_THAT(open_error(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4),
              HasSubstr("tensor 'a' has no \"shape\""));
  EXPECT_THAT(open_error(R"({"a":{"dtype":"F32","shape":[1]}})", 4),
              HasSubstr("tensor 'a' has no \"data_offsets\""));
}

TEST(SafetensorsErrors, ReadErrorsNameTheTensor) {
  const std::string dir = testing::make_temp_dir("st-read-err");
  const std::string path = dir + "/w.safetensors";
  save_safetensors(path, {{"w", at::zeros({4, 6})}, {"s", at::scalar_tensor(1.0)}});
  const auto file = SafetensorsFile::open(path);
  EXPECT_THAT(error_of([&] { file->info("nope"); }),
              AllOf(HasSubstr(path), HasSubstr("no tensor named 'nope'")));
  EXPECT_THAT(error_of([&] { file->read_slices("w", 1, {{2, 7}}); }),
              HasSubstr("tensor 'w' of shape [4, 6]: range [2, 7) along dim 1 is out of bounds for size 6"));
  EXPECT_THAT(error_of([&] { file->read_slices("w", 0, {{3, 2}}); }), HasSubstr("range [3, 2)"));
  EXPECT_THAT(error_of([&] { file->read_slices("w", 2, {{0, 1}}); }),
              HasSubstr("tensor 'w' has 2 dims; cannot slice along dim 2"));
  EXPECT_THAT(error_of([&] { file->read_slices("s", 0, {{0, 1}}); }),
              HasSubstr("tensor 's' is a scalar and cannot be sliced"));
}

TEST(SafetensorsErrors, WriterRefusesBadInput) {
  const std::string dir = testing::make_temp_dir("st-write-err");
  EXPECT_THAT(error_of([&] {
                save_safetensors(dir + "/a.safetensors", {{"w", at::zeros({2})}, {"w", at::zeros({2})}});
              }),
              HasSubstr("tensor 'w' is given twice"));
  EXPECT_THAT(error_of([&] {
                save_safetensors(dir + "/a.safetensors", {{"c", at::zeros({2}, at::kComplexFloat)}});
              }),
              HasSubstr("has no safetensors equivalent"));
}

TEST(CheckpointErrors, IndexNamesMissingFile) {
  const std::string dir = testing::make_temp_dir("ckpt-missing");
  save_safetensors(dir + "/model-00001-of-00002.safetensors", {{"a", at::zeros({2})}});
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})";
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }),
              AllOf(HasSubstr("model.safetensors.index.json: names 'model-00002-of-00002.safetensors' "
                              "(for tensor 'b' and maybe others)"),
                    HasSubstr("does not exist")));
}

TEST(CheckpointErrors, IndexedTensorAbsentFromItsFile) {
  const std::string dir = testing::make_temp_dir("ckpt-absent");
  save_safetensors(dir + "/model-1.safetensors", {{"a", at::zeros({2})}});
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"a": "model-1.safetensors", "ghost": "model-1.safetensors"}})";
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }),
              HasSubstr("tensor 'ghost' is listed for model-1.safetensors but"));
}

TEST(CheckpointErrors, SameTensorInTwoFiles) {
  const std::string dir = testing::make_temp_dir("ckpt-dup");
  save_safetensors(dir + "/model-1.safetensors", {{"a", at::zeros({2})}});
  save_safetensors(dir + "/model-2.safetensors", {{"a", at::zeros({2})}, {"b", at::zeros({1})}});
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})";
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }),
              AllOf(HasSubstr("tensor 'a' is in two files"), HasSubstr("model-1.safetensors"),
                    HasSubstr("model-2.safetensors")));
}

TEST(CheckpointErrors, BadIndex) {
  const std::string dir = testing::make_temp_dir("ckpt-badindex");
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weights": {}})";
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }), HasSubstr("expected an object with a \"weight_map\""));
  std::ofstream(dir + "/model.safetensors.index.json", std::ios::trunc) << "{oops";
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }), HasSubstr("invalid JSON"));
}

TEST(CheckpointErrors, FolderWithoutWeights) {
  const std::string dir = testing::make_temp_dir("ckpt-none");
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }),
              AllOf(HasSubstr(dir), HasSubstr("no weights found (expected diffusion_pytorch_model*.safetensors")));
  save_safetensors(dir + "/outputs.safetensors", {{"a", at::zeros({2})}});
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }),
              HasSubstr("other safetensors files here: outputs.safetensors"));
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir + "/nothing"); }), HasSubstr("no such file or directory"));
}

TEST(CheckpointErrors, AmbiguousWeights) {
  const std::string dir = testing::make_temp_dir("ckpt-ambiguous");
  save_safetensors(dir + "/diffusion_pytorch_model.safetensors", {{"a", at::zeros({2})}});
  save_safetensors(dir + "/diffusion_pytorch_model.fp16.safetensors", {{"a", at::zeros({2}, at::kHalf)}});
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }),
              HasSubstr("ambiguous weights: several files (diffusion_pytorch_model.fp16.safetensors, "
                        "diffusion_pytorch_model.safetensors)"));
  std::ofstream(dir + "/diffusion_pytorch_model.safetensors.index.json") << R"({"weight_map": {}})";
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map": {}})";
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir); }),
              HasSubstr("ambiguous weights: several index files (diffusion_pytorch_model.safetensors.index.json, "
                        "model.safetensors.index.json)"));
}

TEST(CheckpointErrors, UnknownTensorNamesTheCheckpoint) {
  const std::string dir = testing::make_temp_dir("ckpt-unknown");
  save_safetensors(dir + "/model.safetensors", {{"a", at::zeros({2})}});
  const Checkpoint checkpoint = Checkpoint::open(dir);
  EXPECT_THAT(error_of([&] { checkpoint.read("b"); }),
              AllOf(HasSubstr(dir), HasSubstr("checkpoint has no tensor named 'b'")));
}

}  // namespace
}  // namespace shardit::io
