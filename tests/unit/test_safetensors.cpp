// safetensors round trips, zero-copy views, sliced reads (and their byte counts), checkpoints.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "shardit/io/safetensors.h"
#include "support/test_support.h"

namespace shardit::io {
namespace test_safetensors {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

at::Tensor make_tensor(at::ScalarType type, at::IntArrayRef shape, int64_t seed) {
  at::manual_seed(seed);
  const at::Tensor base = at::randn(shape, at::kDouble) * 50;
  if (type == at::kBool) return base > 0;
  if (type == at::kByte) return base.abs().to(type);
  return base.to(type);
}

TEST(Safetensors, RoundTripsEveryDtype) {
  const std::string dir = testing::make_temp_dir("st-roundtrip");
  const std::vector<at::ScalarType> types = {at::kDouble, at::kFloat, at::kHalf,  at::kBFloat16,
                                             at::kLong,   at::kInt,   at::kShort, at::kChar,
                                             at::kByte,   at::kBool};
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (size_t i = 0; i < types.size(); ++i) {
    tensors.emplace_back("t" + std::to_string(i) + "." + c10::toString(types[i]),
                         make_tensor(types[i], {3, static_cast<int64_t>(i) + 2, 5}, 100 + i));
  }
  tensors.emplace_back("scalar", at::scalar_tensor(2.5, at::kFloat));
  tensors.emplace_back("empty", at::empty({0, 7}, at::kFloat));
  // A non-contiguous input is written contiguous.
  tensors.emplace_back("transposed", at::arange(12, at::kFloat).reshape({3, 4}).t());

  const std::string path = dir + "/all.safetensors";
  save_safetensors(path, tensors, {{"format", "pt"}, {"note", "round trip"}});
  const auto file = SafetensorsFile::open(path);

  std::vector<std::string> expected_names;
  for (const auto& item : tensors) expected_names.push_back(item.first);
  EXPECT_EQ(file->names(), expected_names);  // offset order == written order
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->metadata().at("note"), "round trip");

  for (const auto& [name, tensor] : tensors) {
    SCOPED_TRACE(name);
    const TensorInfo& info = file->info(name);
    EXPECT_EQ(to_scalar_type(info.dtype), tensor.scalar_type());
    EXPECT_EQ(info.shape, tensor.sizes().vec());
    EXPECT_EQ(static_cast<int64_t>(info.nbytes()), tensor.numel() * tensor.element_size());
    const at::Tensor read = file->read(name);
    EXPECT_EQ(read.scalar_type(), tensor.scalar_type());
    EXPECT_TRUE(at::equal(read, tensor));
    EXPECT_TRUE(at::equal(file->view(name), tensor));
  }
}

TEST(Safetensors, WriterPadsHeaderWithSpacesAndWritesLittleEndian) {
  const std::string dir = testing::make_temp_dir("st-layout");
  const std::string path = dir + "/a.safetensors";
  save_safetensors(path, {{"a", at::tensor({1, 258}, at::kInt)}, {"bb", at::tensor({3}, at::kShort)}});
  const std::string bytes = read_bytes(path);
  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  EXPECT_EQ(header_size % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + header_size + 8 + 2);
  const std::string header = bytes.substr(8, header_size);
  EXPECT_EQ(header.front(), '{');
  const size_t last = header.find_last_not_of(' ');
  EXPECT_EQ(header[last], '}');
  EXPECT_LT(header.size() - last - 1, 8u);
  const std::string data = bytes.substr(8 + header_size);
  EXPECT_EQ(data, std::string("\x01\x00\x00\x00\x02\x01\x00\x00\x03\x00", 10));
}

TEST(Safetensors, ViewAliasesTheMappingAndOutlivesTheFile) {
  const std::string dir = testing::make_temp_dir("st-view");
  const std::string path = dir + "/v.safetensors";
  const at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3});
  const at::Tensor b = at::arange(10, at::kDouble);
  save_safetensors(path, {{"a", a}, {"b", b}});

  auto file = SafetensorsFile::open(path);
  const at::Tensor view_a = file->view("a");
  const at::Tensor view_a2 = file->view("a");
  const at::Tensor view_b = file->view("b");
  // Same bytes, no copy: both views point at one place, and b starts right after a.
  EXPECT_EQ(view_a.data_ptr(), view_a2.data_ptr());
  EXPECT_EQ(static_cast<const char*>(view_b.data_ptr()),
            static_cast<const char*>(view_a.data_ptr()) + file->info("b").begin);
  // read() copies.
  EXPECT_NE(file->read("a").data_ptr(), view_a.data_ptr());

  file.reset();  // the views keep the mapping alive
  EXPECT_TRUE(at::equal(view_a, a));
  EXPECT_TRUE(at::equal(view_b, b));
}

TEST(Safetensors, ReadConvertsDtype) {
  const std::string dir = testing::make_temp_dir("st-convert");
  const std::string path = dir + "/c.safetensors";
  const at::Tensor x = at::randn({4, 5}, at::kFloat);
  save_safetensors(path, {{"x", x}});
  const auto file = SafetensorsFile::open(path);
  const at::Tensor as_double = file->read("x", at::kDouble);
  EXPECT_EQ(as_double.scalar_type(), at::kDouble);
  EXPECT_TRUE(at::equal(as_double, x.to(at::kDouble)));
  const at::Tensor as_bf16 = file->read("x", at::kBFloat16);
  EXPECT_EQ(as_bf16.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(as_bf16, x.to(at::kBFloat16)));
}

struct SliceCase {
  std::vector<int64_t> shape;
  int64_t dim;
  std::vector<Range> ranges;
};

TEST(Safetensors, ReadSlicesEqualsNarrowCatAndReadsOnlyThoseBytes) {
  const std::string dir = testing::make_temp_dir("st-slices");
  const std::string path = dir + "/s.safetensors";
  const at::Tensor before = at::randn({3}, at::kFloat);
  const at::Tensor w2 = at::randn({12, 10}, at::kFloat);
  const at::Tensor w3 = at::randn({5, 9, 4}, at::kDouble);
  const at::Tensor h = at::randn({7, 6}, at::kFloat).to(at::kHalf);
  save_safetensors(path, {{"before", before}, {"w2", w2}, {"w3", w3}, {"h", h}});

  const std::vector<std::pair<std::string, SliceCase>> cases = {
      {"w2", {{12, 10}, 0, {{4, 8}}}},                     // one colwise shard
      {"w2", {{12, 10}, 1, {{5, 10}}}},                    // one rowwise shard
      {"w2", {{12, 10}, 0, {{0, 2}, {6, 8}, {10, 12}}}},   // packed [q|k|v] shard 0 of 2
      {"w2", {{12, 10}, 0, {{10, 12}, {0, 1}}}},           // out of order
      {"w2", {{12, 10}, 1, {{0, 3}, {7, 9}}}},             // packed rowwise
      {"w2", {{12, 10}, -1, {{2, 3}}}},                    // negative dim
      {"w2", {{12, 10}, 0, {{3, 3}}}},                     // empty range
      {"w3", {{5, 9, 4}, 1, {{1, 4}, {6, 9}}}},            // middle dim
      {"w3", {{5, 9, 4}, 2, {{0, 1}, {3, 4}}}},            // last dim, one element per span
      {"w3", {{5, 9, 4}, 0, {{0, 5}}}},                    // everything
      {"h", {{7, 6}, 0, {{1, 2}, {4, 7}}}},
  };
  for (const auto& [name, c] : cases) {
    SCOPED_TRACE(name + " dim " + std::to_string(c.dim));
    auto stats = std::make_shared<ReadStats>();
    const auto file = SafetensorsFile::open(path, stats);
    const at::Tensor full = file->read(name);
    ASSERT_EQ(full.sizes().vec(), c.shape);
    stats->bytes_read = 0;
    stats->tensors_read = 0;

    const at::Tensor got = file->read_slices(name, c.dim, c.ranges);
    std::vector<at::Tensor> pieces;
    int64_t slice_elements = 0;
    for (const Range& r : c.ranges) {
      pieces.push_back(full.narrow(c.dim, r.begin, r.size()));
      slice_elements += pieces.back().numel();
    }
    const at::Tensor expected = at::cat(pieces, c.dim);
    EXPECT_EQ(got.sizes(), expected.sizes());
    EXPECT_TRUE(at::equal(got, expected));
    EXPECT_EQ(stats->bytes_read.load(), static_cast<uint64_t>(slice_elements * full.element_size()));
    EXPECT_EQ(stats->tensors_read.load(), 1u);
  }
}

TEST(Safetensors, ReadSlicesConvertsDtype) {
  const std::string dir = testing::make_temp_dir("st-slices-dtype");
  const std::string path = dir + "/s.safetensors";
  const at::Tensor w = at::randn({6, 4}, at::kFloat);
  save_safetensors(path, {{"w", w}});
  auto stats = std::make_shared<ReadStats>();
  const auto file = SafetensorsFile::open(path, stats);
  const at::Tensor got = file->read_slices("w", 1, {{1, 3}}, at::kDouble);
  EXPECT_EQ(got.scalar_type(), at::kDouble);
  EXPECT_TRUE(at::equal(got, w.narrow(1, 1, 2).to(at::kDouble)));
  EXPECT_EQ(stats->bytes_read.load(), 6u * 2 * 4);  // counted in the file's dtype
}

TEST(Safetensors, Float8IsParsedEvenWhereLibTorchLacksIt) {
  const std::string header = R"({"a":{"dtype":"F8_E4M3","shape":[2,3],"data_offsets":[0,6]},)"
                             R"("b":{"dtype":"F8_E5M2","shape":[2],"data_offsets":[6,8]}})";
  const auto infos = SafetensorsFile::parse_header("f8.safetensors", header.data(), header.size(), 8, nullptr);
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_EQ(infos[0].dtype, StDtype::F8_E4M3);
  EXPECT_EQ(infos[1].dtype, StDtype::F8_E5M2);
  EXPECT_EQ(st_dtype_size(StDtype::F8_E4M3), 1);
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 1)
  try {
    to_scalar_type(StDtype::F8_E4M3);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("F8_E4M3 needs LibTorch >= 2.1"));
  }
#else
  EXPECT_EQ(from_scalar_type(to_scalar_type(StDtype::F8_E5M2)), StDtype::F8_E5M2);
#endif
}

TEST(Safetensors, DtypeNamesRoundTrip) {
  for (const char* name : {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL",
                            "F8_E4M3", "F8_E5M2"}) {
    EXPECT_STREQ(st_dtype_name(st_dtype_from_name(name, "test")), name);
  }
}

TEST(Checkpoint, OpensFileAndFolderWithSortedNames) {
  const std::string dir = testing::make_temp_dir("ckpt-single");
  const at::Tensor z = at::randn({2, 2});
  const at::Tensor a = at::randn({3});
  save_safetensors(dir + "/diffusion_pytorch_model.safetensors", {{"z.weight", z}, {"a.bias", a}});
  save_safetensors(dir + "/inputs.safetensors", {{"unrelated", a}});  // not weights: ignored

  for (const std::string& path : {dir, dir + "/diffusion_pytorch_model.safetensors"}) {
    SCOPED_TRACE(path);
    const Checkpoint checkpoint = Checkpoint::open(path);
    EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"a.bias", "z.weight"}));
    EXPECT_TRUE(checkpoint.contains("a.bias"));
    EXPECT_FALSE(checkpoint.contains("unrelated"));
    EXPECT_TRUE(at::equal(checkpoint.read("z.weight"), z));
    EXPECT_EQ(checkpoint.info("a.bias").shape, std::vector<int64_t>{3});
    EXPECT_EQ(checkpoint.files().size(), 1u);
  }

  const std::string transformers_dir = testing::make_temp_dir("ckpt-model");
  save_safetensors(transformers_dir + "/model.safetensors", {{"x", a}});
  EXPECT_EQ(Checkpoint::open(transformers_dir).names(), std::vector<std::string>{"x"});
}

TEST(Checkpoint, ShardedViaIndexSharesReadStats) {
  const std::string dir = testing::make_temp_dir("ckpt-sharded");
  const at::Tensor a = at::randn({4, 6});
  const at::Tensor b = at::randn({8});
  const at::Tensor c = at::randn({2, 3}, at::kDouble);
  save_safetensors(dir + "/diffusion_pytorch_model-00001-of-00002.safetensors", {{"b", b}, {"a", a}});
  save_safetensors(dir + "/diffusion_pytorch_model-00002-of-00002.safetensors", {{"c", c}});
  std::ofstream(dir + "/diffusion_pytorch_model.safetensors.index.json")
      << R"({"metadata": {"total_size": 200}, "weight_map": {)"
      << R"("a": "diffusion_pytorch_model-00001-of-00002.safetensors",)"
      << R"("b": "diffusion_pytorch_model-00001-of-00002.safetensors",)"
      << R"("c": "diffusion_pytorch_model-00002-of-00002.safetensors"}})";

  for (const std::string& path : {dir, dir + "/diffusion_pytorch_model.safetensors.index.json"}) {
    SCOPED_TRACE(path);
    const Checkpoint checkpoint = Checkpoint::open(path);
    EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"a", "b", "c"}));
    EXPECT_EQ(checkpoint.files().size(), 2u);
    EXPECT_THAT(checkpoint.file_of("c").path(), HasSubstr("00002-of-00002"));
    EXPECT_TRUE(at::equal(checkpoint.read("c"), c));
    EXPECT_TRUE(at::equal(checkpoint.read_slices("a", 1, {{2, 4}}), a.narrow(1, 2, 2)));
    EXPECT_EQ(checkpoint.stats().bytes_read.load(), 2u * 3 * 8 + 4u * 2 * 4);
    EXPECT_EQ(checkpoint.stats().tensors_read.load(), 2u);
  }
}

TEST(Checkpoint, GoldenFluxWeightsReadAndSlice) {
  const Checkpoint checkpoint = Checkpoint::open(testing::golden_path("flux_b1_square"));
  const TensorInfo& info = checkpoint.info("x_embedder.weight");
  EXPECT_EQ(info.dtype, StDtype::F32);
  ASSERT_EQ(info.shape.size(), 2u);
  const at::Tensor full = checkpoint.read("x_embedder.weight");
  EXPECT_EQ(full.sizes().vec(), info.shape);
  const at::Tensor view = checkpoint.file_of("x_embedder.weight").view("x_embedder.weight");
  EXPECT_TRUE(at::equal(full, view));
  // The middle third of the rows, and of the columns (the rows and columns of a TP=3 shard).
  const int64_t rows = info.shape[0], cols = info.shape[1];
  EXPECT_TRUE(at::equal(checkpoint.read_slices("x_embedder.weight", 0, {{rows / 3, 2 * rows / 3}}),
                        full.narrow(0, rows / 3, 2 * rows / 3 - rows / 3)));
  EXPECT_TRUE(at::equal(checkpoint.read_slices("x_embedder.weight", 1, {{cols / 3, 2 * cols / 3}}),
                        full.narrow(1, cols / 3, 2 * cols / 3 - cols / 3)));
}

}  // namespace
}  // namespace test_safetensors
}  // namespace shardit::io
