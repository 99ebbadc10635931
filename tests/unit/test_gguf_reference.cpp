// shardit's GGUF dequantization against gguf-py's, bit for bit: tests/golden/tools/make_gguf_cases.py
// writes, with the pinned gguf-py release (its own quantizer where it has one, random codes with
// valid scales where it has none), a GGUF file of every supported type in several shapes and
// gguf.quants.dequantize's float32 values; every tensor is compared whole, and per rank at TP 1-4
// split by rows and by blocks of each row (with the refusal, listing the degrees that work, where
// the blocks of a row do not split).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <filesystem>
#include <set>

#include "shardit/io/gguf.h"
#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "shardit/nn/gguf_dequantize.h"
#include "support/test_support.h"

namespace shardit::io {
namespace test_gguf_reference {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using shardit::testing::error_of;

// The folder of this test program (the build's tests/ folder): the cases and their virtual
// environment are kept beside it.
fs::path build_tests_dir() { return fs::read_symlink("/proc/self/exe").parent_path(); }

/// "" when equal bit for bit; otherwise the first differing index with both values.
std::string bit_difference(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.sizes() != expected.sizes()) {
    return c10::str("shape ", actual.sizes(), " against the reference's ", expected.sizes());
  }
  const at::Tensor a = actual.contiguous().view(at::kInt).reshape(-1);
  const at::Tensor e = expected.contiguous().view(at::kInt).reshape(-1);
  const at::Tensor differ = a.ne(e).nonzero();
  if (differ.numel() == 0) return "";
  const int64_t i = differ[0][0].item<int64_t>();
  const at::Tensor af = actual.contiguous().reshape(-1);
  const at::Tensor ef = expected.contiguous().reshape(-1);
  return c10::str(differ.size(0), " elements differ; first at flat index ", i, ": ", af[i].item<float>(), " (bits 0x",
                  std::hex, a[i].item<int32_t>(), ") against gguf-py's ", ef[i].item<float>(), " (bits 0x",
                  e[i].item<int32_t>(), ")");
}

class GgufGolden : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const fs::path out = build_tests_dir() / "gguf_cases";
    const std::string command = "python3 '" + std::string(SHARDIT_SOURCE_DIR) +
                                "/tests/golden/tools/make_gguf_cases.py' --venv '" +
                                (build_tests_dir() / "gguf-venv").string() + "' --out '" + out.string() + "'";
    std::string output;
    tool_status_ = testing::run_command(command, &output);
    tool_output_ = output;
    cases_dir_ = out.string();
  }
  void SetUp() override {
    if (tool_status_ == 77) GTEST_SKIP() << "make_gguf_cases.py: " << tool_output_;
    ASSERT_EQ(tool_status_, 0) << "make_gguf_cases.py failed:\n" << tool_output_;
    gguf_ = GgufFile::open(cases_dir_ + "/cases.gguf");
    reference_ = SafetensorsFile::open(cases_dir_ + "/reference.safetensors");
    cases_ = read_json_file(cases_dir_ + "/cases.json");
  }
  // gguf-py's values of `name` as [rows, row length].
  at::Tensor expected(const GgufTensorInfo& info) const {
    return reference_->read(info.name).reshape({info.rows(), info.row_length()});
  }

  static inline int tool_status_ = -1;
  static inline std::string tool_output_;
  static inline std::string cases_dir_;
  std::shared_ptr<GgufFile> gguf_;
  std::shared_ptr<SafetensorsFile> reference_;
  nlohmann::json cases_;
};

TEST_F(GgufGolden, CoversEveryTypeAndTheMetadata) {
  std::set<std::string> types;
  for (const auto& c : cases_.at("cases")) {
    const GgufTensorInfo& info = gguf_->info(c.at("name").get<std::string>());
    EXPECT_EQ(ggml_type_name(info.type), c.at("type").get<std::string>()) << info.name;
    EXPECT_EQ(info.shape(), c.at("shape").get<std::vector<int64_t>>()) << info.name;
    types.insert(ggml_type_name(info.type));
  }
  EXPECT_EQ(types, (std::set<std::string>{"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
                                          "Q6_K", "Q8_K"}));
  EXPECT_EQ(gguf_->tensors().size(), cases_.at("cases").size());
  const auto& metadata = cases_.at("metadata");
  EXPECT_EQ(gguf_->find_metadata("general.name")->string("general.name"), metadata.at("general.name").get<std::string>());
  EXPECT_EQ(gguf_->find_metadata("general.architecture")->string("general.architecture"), "flux");
  EXPECT_EQ(gguf_->find_metadata("shardit.scale")->number("shardit.scale"), metadata.at("shardit.scale").get<double>());
  EXPECT_TRUE(gguf_->find_metadata("shardit.flag")->boolean("shardit.flag"));
  const GgufValue& rows = *gguf_->find_metadata("shardit.rows");
  ASSERT_EQ(rows.count, 3u);
  for (uint64_t i = 0; i < 3; ++i) EXPECT_EQ(rows.element(i).integer("shardit.rows"), metadata.at("shardit.rows")[i]);
  const GgufValue& names = *gguf_->find_metadata("shardit.names");
  ASSERT_EQ(names.count, 2u);
  EXPECT_EQ(names.element(1).string("shardit.names"), "bc");
}

TEST_F(GgufGolden, WholeTensorsMatchGgufPyBitForBit) {
  for (const auto& info : gguf_->tensors()) {
    const at::Tensor ours = nn::gguf_dequantize(gguf_->view(info.name), info.type, at::kFloat, info.name);
    EXPECT_EQ(bit_difference(ours, expected(info)), "") << info.name;
  }
}

TEST_F(GgufGolden, RankSlicesMatchGgufPyBitForBit) {
  int rows_checked = 0;
  int blocks_checked = 0;
  int refusals = 0;
  for (const auto& info : gguf_->tensors()) {
    const at::Tensor reference = expected(info);
    const int64_t block = ggml_block(info.type).block_size;
    for (int64_t degree = 1; degree <= 4; ++degree) {
      const bool rows_split = info.rows() % degree == 0;
      const bool blocks_split = info.blocks_per_row() % degree == 0;
      for (int64_t rank = 0; rank < degree; ++rank) {
        const std::string where = c10::str(info.name, " at TP ", degree, " rank ", rank);
        if (rows_split) {
          const Range rows = nn::gguf_rank_rows(info, degree, rank);
          const at::Tensor ours = nn::gguf_dequantize(gguf_->read_rows(info.name, rows), info.type);
          EXPECT_EQ(bit_difference(ours, reference.narrow(0, rows.begin, rows.size())), "") << where << " (rows)";
          ++rows_checked;
        } else {
          EXPECT_THAT(error_of([&] { nn::gguf_rank_rows(info, degree, rank); }),
                      HasSubstr("degrees that work: " + testing::divisors_of(info.rows())));
        }
        if (blocks_split) {
          const Range blocks = nn::gguf_rank_blocks(info, degree, rank);
          const at::Tensor bytes = gguf_->read_row_blocks(info.name, Range{0, info.rows()}, blocks);
          const at::Tensor ours = nn::gguf_dequantize(bytes, info.type);
          const at::Tensor columns = reference.narrow(1, blocks.begin * block, blocks.size() * block);
          EXPECT_EQ(bit_difference(ours, columns), "") << where << " (blocks)";
          ++blocks_checked;
        } else {
          EXPECT_THAT(error_of([&] { nn::gguf_rank_blocks(info, degree, rank); }),
                      HasSubstr("which tensor-parallel degree " + std::to_string(degree) +
                                " does not split evenly; degrees that work: " +
                                testing::divisors_of(info.blocks_per_row())));
          ++refusals;
        }
      }
    }
  }
  // The shapes were chosen so that every kind of check happens (make_gguf_cases.py's SHAPES).
  EXPECT_GT(rows_checked, 0);
  EXPECT_GT(blocks_checked, 0);
  EXPECT_GT(refusals, 0);
}

}  // namespace
}  // namespace test_gguf_reference
}  // namespace shardit::io
