// GGUF files read from hand-built bytes: metadata of every value type, versions 2 and 3, the
// alignment, tensor infos in both dimension orders, zero-copy views and reads of only some rows or
// blocks; and dequantization of blocks whose values can be worked out by hand. (Bit-exactness
// against gguf-py over every type: test_gguf_reference.cpp.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <c10/util/Half.h>

#include <random>

#include "shardit/io/gguf.h"
#include "shardit/nn/gguf_dequantize.h"
#include "shardit/nn/gguf_linear.h"
#include "shardit/nn/linear.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/gguf_bytes.h"
#include "support/test_support.h"

namespace shardit::io {
namespace test_gguf {
namespace {

using ::testing::HasSubstr;
using shardit::testing::error_of;
using shardit::testing::GgufBytes;
using shardit::testing::gguf_string;
using shardit::testing::le_u32;
using shardit::testing::le_u64;

std::string half_bytes(float value) {
  const c10::Half h(value);
  return std::string(reinterpret_cast<const char*>(&h.x), 2);
}

template <class T>
std::string raw(T value) {
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}

std::string write(const GgufBytes& file, const std::string& tag) {
  return file.write(testing::make_temp_dir(tag) + "/x.gguf");
}

TEST(Gguf, ReadsEveryMetadataValueType) {
  GgufBytes file;
  file.kv("u8", 0, raw<uint8_t>(200)).kv("i8", 1, raw<int8_t>(-100)).kv("u16", 2, raw<uint16_t>(60000));
  file.kv("i16", 3, raw<int16_t>(-30000)).kv_u32("u32", 4000000000u).kv("i32", 5, raw<int32_t>(-2000000000));
  file.kv("f32", 6, raw<float>(0.5f)).kv("bool", 7, raw<uint8_t>(1)).kv_string("general.architecture", "flux");
  file.kv("u64", 10, raw<uint64_t>(uint64_t{1} << 40)).kv("i64", 11, raw<int64_t>(-(int64_t{1} << 40)));
  file.kv("f64", 12, raw<double>(0.25));
  file.kv("ints", 9, le_u32(5) + le_u64(3) + raw<int32_t>(1) + raw<int32_t>(-2) + raw<int32_t>(3));
  file.kv("strings", 9, le_u32(8) + le_u64(2) + gguf_string("a") + gguf_string(""));
  file.kv("nested", 9, le_u32(9) + le_u64(2) + le_u32(0) + le_u64(1) + raw<uint8_t>(9) + le_u32(8) + le_u64(1) +
                           gguf_string("x"));
  const auto gguf = GgufFile::open(write(file, "gguf-kv"));
  EXPECT_EQ(gguf->version(), 3u);
  EXPECT_EQ(gguf->alignment(), 32u);
  ASSERT_EQ(gguf->metadata().size(), 15u);
  EXPECT_EQ(gguf->metadata()[0].first, "u8");  // file order
  auto at = [&](const std::string& key) -> const GgufValue& {
    const GgufValue* value = gguf->find_metadata(key);
    if (value == nullptr) throw std::runtime_error("no metadata " + key);
    return *value;
  };
  EXPECT_EQ(at("u8").integer("u8"), 200);
  EXPECT_EQ(at("i8").integer("i8"), -100);
  EXPECT_EQ(at("u16").integer("u16"), 60000);
  EXPECT_EQ(at("i16").integer("i16"), -30000);
  EXPECT_EQ(at("u32").integer("u32"), 4000000000);
  EXPECT_EQ(at("i32").integer("i32"), -2000000000);
  EXPECT_EQ(at("f32").number("f32"), 0.5);
  EXPECT_TRUE(at("bool").boolean("bool"));
  EXPECT_EQ(at("general.architecture").string("general.architecture"), "flux");
  EXPECT_EQ(at("u64").integer("u64"), int64_t{1} << 40);
  EXPECT_EQ(at("i64").integer("i64"), -(int64_t{1} << 40));
  EXPECT_EQ(at("f64").number("f64"), 0.25);
  EXPECT_EQ(at("ints").describe(), "array of 3 int32");
  EXPECT_EQ(at("ints").element(1).integer("ints[1]"), -2);
  EXPECT_EQ(at("strings").element(0).string("strings[0]"), "a");
  EXPECT_EQ(at("strings").element(1).string("strings[1]"), "");
  EXPECT_EQ(at("nested").element(0).element(0).integer("nested[0][0]"), 9);
  EXPECT_EQ(at("nested").element(1).element(0).string("nested[1][0]"), "x");
  EXPECT_EQ(gguf->find_metadata("absent"), nullptr);
  EXPECT_THAT(error_of([&] { at("general.architecture").integer("general.architecture"); }),
              HasSubstr("GGUF metadata 'general.architecture' is string \"flux\", expected an integer"));
}

// Version 2 has version 3's layout (3 added big-endian files); both read alike.
TEST(Gguf, ReadsVersionTwoAndACustomAlignment) {
  GgufBytes file;
  file.version = 2;
  file.alignment = 64;
  file.kv_u32("general.alignment", 64);
  file.tensor("a", {4}, 0, 0).tensor("b", {2, 3}, 1, 64);
  file.data = std::string(64, '\1') + std::string(12, '\2');
  const auto gguf = GgufFile::open(write(file, "gguf-v2"));
  EXPECT_EQ(gguf->version(), 2u);
  EXPECT_EQ(gguf->alignment(), 64u);
  const GgufTensorInfo& b = gguf->info("b");
  EXPECT_EQ(b.dims, (std::vector<int64_t>{2, 3}));   // GGUF order: innermost first
  EXPECT_EQ(b.shape(), (std::vector<int64_t>{3, 2}));  // LibTorch order
  EXPECT_EQ(b.rows(), 3);
  EXPECT_EQ(b.row_bytes(), 4u);
  EXPECT_EQ(b.nbytes, 12u);
  EXPECT_EQ(b.offset, 64u);
  EXPECT_TRUE(gguf->view("b").eq(2).all().item<bool>());
}

TEST(Gguf, ViewsAliasTheMappingAndReadsCopyOnlyTheirBytes) {
  // Q8_0 [3 rows, 64] (2 blocks a row): block (r, b) has scale r + 1 and codes b * 10 + i.
  GgufBytes file;
  file.tensor("q", {64, 3}, 8, 0);
  for (int r = 0; r < 3; ++r) {
    for (int b = 0; b < 2; ++b) {
      file.data += half_bytes(static_cast<float>(r + 1));
      for (int i = 0; i < 32; ++i) file.data += static_cast<char>(b * 10 + i % 8);
    }
  }
  auto stats = std::make_shared<ReadStats>();
  const auto gguf = GgufFile::open(write(file, "gguf-reads"), stats);
  const at::Tensor view = gguf->view("q");
  EXPECT_EQ(view.sizes(), (std::vector<int64_t>{3, 68}));
  EXPECT_EQ(view.scalar_type(), at::kByte);
  EXPECT_EQ(stats->bytes_read.load(), 0u);  // a view copies nothing

  const at::Tensor rows = gguf->read_rows("q", {1, 3});
  EXPECT_TRUE(rows.equal(view.narrow(0, 1, 2)));
  EXPECT_EQ(stats->bytes_read.load(), 2u * 68);
  const at::Tensor blocks = gguf->read_row_blocks("q", {0, 3}, {1, 2});
  EXPECT_TRUE(blocks.equal(view.narrow(1, 34, 34)));
  EXPECT_EQ(stats->bytes_read.load(), 2u * 68 + 3u * 34);

  const at::Tensor weights = nn::gguf_dequantize(view, GgmlType::Q8_0);
  ASSERT_EQ(weights.sizes(), (std::vector<int64_t>{3, 64}));
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 64; ++c) {
      ASSERT_EQ(weights[r][c].item<float>(), static_cast<float>((r + 1) * ((c / 32) * 10 + c % 8))) << r << "," << c;
    }
  }
  // A rank's blocks dequantize to its columns.
  EXPECT_TRUE(nn::gguf_dequantize(blocks, GgmlType::Q8_0).equal(weights.narrow(1, 32, 32)));
  EXPECT_EQ(nn::gguf_dequantize(view, GgmlType::Q8_0, at::kBFloat16).scalar_type(), at::kBFloat16);
}

// Q4_0: (nibble - 8) * d, low nibbles first; Q4_1: nibble * d + m.
TEST(Gguf, DequantizesFourBitBlocksByHand) {
  std::string q4_0 = half_bytes(0.5f);
  std::string q4_1 = half_bytes(2.0f) + half_bytes(-1.0f);
  for (int i = 0; i < 16; ++i) {
    q4_0 += static_cast<char>(i | (15 - i) << 4);
    q4_1 += static_cast<char>(i | (15 - i) << 4);
  }
  auto bytes = [](const std::string& s) {
    return at::from_blob(const_cast<char*>(s.data()), {1, static_cast<int64_t>(s.size())}, at::kByte).clone();
  };
  const at::Tensor a = nn::gguf_dequantize(bytes(q4_0), GgmlType::Q4_0);
  const at::Tensor b = nn::gguf_dequantize(bytes(q4_1), GgmlType::Q4_1);
  for (int j = 0; j < 32; ++j) {
    const int nibble = j < 16 ? j : 15 - (j - 16);
    EXPECT_EQ(a[0][j].item<float>(), (nibble - 8) * 0.5f) << j;
    EXPECT_EQ(b[0][j].item<float>(), nibble * 2.0f - 1.0f) << j;
  }
}

TEST(Gguf, RankSharesOfRowsAndBlocks) {
  GgufTensorInfo info;
  info.name = "blocks.0.w";
  info.type = GgmlType::Q4_K;
  info.dims = {768, 12};  // [12, 768]: 3 blocks a row
  EXPECT_EQ(nn::gguf_rank_rows(info, 4, 3), (Range{9, 12}));
  EXPECT_EQ(nn::gguf_rank_blocks(info, 3, 1), (Range{1, 2}));
  EXPECT_EQ(error_of([&] { nn::gguf_rank_blocks(info, 2, 0); }),
            "GGUF tensor 'blocks.0.w' (Q4_K, LibTorch shape [12, 768]) has 3 blocks of 256 elements in each row (a "
            "rowwise split cuts rows on block boundaries only), which tensor-parallel degree 2 does not split evenly; "
            "degrees that work: 1, 3");
  EXPECT_THAT(error_of([&] { nn::gguf_rank_rows(info, 5, 0); }),
              HasSubstr("has 12 rows (a colwise split keeps rows whole), which tensor-parallel degree 5 does not split "
                        "evenly; degrees that work: 1, 2, 3, 4, 6, 12"));
}


// Q4_K blocks of random bytes with valid (finite, positive) fp16 scales.
std::string random_q4_k_blocks(int64_t count, uint32_t seed) {
  std::mt19937 random(seed);
  std::string out;
  for (int64_t b = 0; b < count; ++b) {
    std::string block(144, '\0');
    for (char& c : block) c = static_cast<char>(random() & 0xFF);
    const std::string d = half_bytes(0.001f * static_cast<float>(1 + random() % 50));
    const std::string dmin = half_bytes(0.0005f * static_cast<float>(1 + random() % 50));
    block.replace(0, 2, d);
    block.replace(2, 2, dmin);
    out += block;
  }
  return out;
}

/// A file with "w": Q4_K [6, 768] (3 blocks a row) and "h": F16 [6, 768].
std::shared_ptr<GgufFile> linear_file() {
  GgufBytes file;
  file.tensor("w", {768, 6}, 12, 0).tensor("h", {768, 6}, 1, 6 * 432);
  file.data = random_q4_k_blocks(18, 7) + std::string(6 * 768 * 2, '\0');
  return GgufFile::open(write(file, "gguf-linear"));
}

at::Tensor bits(const at::Tensor& t) { return t.contiguous().view(at::kInt); }

TEST(GgufLinear, HoldsBlocksAndDequantizesThemPerForward) {
  const auto gguf = linear_file();
  const at::Tensor whole = nn::gguf_dequantize(gguf->view("w"), GgmlType::Q4_K);  // [6, 768]
  nn::Linear linear(nn::LinearOptions(768, 6).with_bias(false));
  nn::load_gguf_linear(linear, *gguf, "w", nn::LinearParallel::None, 1, 0, at::kFloat);
  EXPECT_EQ(linear.weight_format(), nn::WeightFormat::GgufQ4_K);
  EXPECT_EQ(linear.weight.sizes(), (std::vector<int64_t>{6, 3 * 144}));  // held as stored
  EXPECT_EQ(linear.weight_in_features(), 768);
  EXPECT_EQ(nn::gguf_linear_rank_bytes(gguf->info("w"), nn::LinearParallel::None, 1), 6 * 432);
  EXPECT_TRUE(bits(linear.dense_weight(at::kFloat)).equal(bits(whole)));
  EXPECT_TRUE(linear.dense_weight(at::kBFloat16).equal(whole.to(at::kBFloat16)));
  const at::Tensor x = at::sin(at::arange(2 * 5 * 768, at::kFloat)).reshape({2, 5, 768});
  // The product runs on the dequantized weight (its kernel's rounding may differ from matmul's).
  const at::Tensor reference = at::matmul(x, whole.t());
  EXPECT_LE((linear.forward(x) - reference).abs().max().item<float>(), 1e-5 * reference.abs().max().item<float>());
}

TEST(GgufLinear, RanksHoldTheirRowsOrTheirBlocksOfEveryRow) {
  const auto gguf = linear_file();
  const GgufTensorInfo& info = gguf->info("w");
  const at::Tensor whole = nn::gguf_dequantize(gguf->view("w"), GgmlType::Q4_K);  // [6, 768]
  const at::Tensor x = at::sin(at::arange(4 * 768, at::kFloat)).reshape({4, 768});
  const at::Tensor full = at::matmul(x, whole.t());
  for (const int64_t degree : {2, 3}) {
    for (int64_t rank = 0; rank < degree; ++rank) {
      nn::Linear colwise(nn::LinearOptions(768, 6).with_bias(false));
      nn::load_gguf_linear(colwise, *gguf, "w", nn::LinearParallel::Colwise, degree, rank, at::kFloat);
      const int64_t rows = 6 / degree;
      EXPECT_TRUE(bits(colwise.dense_weight(at::kFloat)).equal(bits(whole.narrow(0, rank * rows, rows))))
          << "colwise rank " << rank << " of " << degree;
      EXPECT_EQ(colwise.weight.numel(), nn::gguf_linear_rank_bytes(info, nn::LinearParallel::Colwise, degree));
    }
  }
  at::Tensor partial_sum = at::zeros_like(full);
  for (int64_t rank = 0; rank < 3; ++rank) {
    nn::Linear rowwise(nn::LinearOptions(768, 6).with_bias(false));
    nn::load_gguf_linear(rowwise, *gguf, "w", nn::LinearParallel::Rowwise, 3, rank, at::kFloat);
    EXPECT_EQ(rowwise.weight_in_features(), 256);
    EXPECT_TRUE(bits(rowwise.dense_weight(at::kFloat)).equal(bits(whole.narrow(1, rank * 256, 256))))
        << "rowwise rank " << rank;
    EXPECT_EQ(rowwise.weight.numel(), nn::gguf_linear_rank_bytes(info, nn::LinearParallel::Rowwise, 3));
    partial_sum += rowwise.forward(x.narrow(1, rank * 256, 256));  // what the all-reduce sums
  }
  // Three partial dot products summed instead of one: equal within the fp32 rounding of the sums,
  // relative to the output's scale.
  EXPECT_LE((partial_sum - full).abs().max().item<float>(), 1e-5 * full.abs().max().item<float>());
}

TEST(GgufLinear, Refusals) {
  const auto gguf = linear_file();
  nn::Linear linear(nn::LinearOptions(768, 6).with_bias(false));
  EXPECT_THAT(error_of([&] { nn::load_gguf_linear(linear, *gguf, "w", nn::LinearParallel::Rowwise, 2, 0, at::kFloat); }),
              HasSubstr("has 3 blocks of 256 elements in each row (a rowwise split cuts rows on block boundaries "
                        "only), which tensor-parallel degree 2 does not split evenly; degrees that work: 1, 3"));
  EXPECT_THAT(error_of([&] { nn::load_gguf_linear(linear, *gguf, "h", nn::LinearParallel::None, 1, 0, at::kFloat); }),
              HasSubstr("tensor 'h' is stored as ggml type F16, which a Linear does not hold as blocks"));
  nn::Linear other(nn::LinearOptions(512, 6).with_bias(false));
  EXPECT_THAT(error_of([&] { nn::load_gguf_linear(other, *gguf, "w", nn::LinearParallel::None, 1, 0, at::kFloat); }),
              HasSubstr("tensor 'w' (Q4_K) has LibTorch shape [6, 768], but Linear '"));
  nn::load_gguf_linear(linear, *gguf, "w", nn::LinearParallel::None, 1, 0, at::kFloat);
  EXPECT_THAT(error_of([&] { linear.forward(at::zeros({1, 432})); }),
              HasSubstr("input has 432 features, the weight [6, 432] (gguf-q4_k blocks) expects 768"));
}


// The plan counts a GGUF weight as stored: Q4_K holds 256 elements in 144 bytes.
TEST(GgufLinear, PlanCountsBlocksAsStored) {
  parallel::ShardSpec spec;
  spec.parameter = "blocks.0.w";
  spec.full_shape = {3072, 3072};
  spec.dim = 1;  // rowwise at TP 4: 768 columns = 3 blocks of each row per rank
  for (int64_t r = 0; r < 4; ++r) spec.ranges_per_rank.push_back({Range{r * 768, (r + 1) * 768}});
  spec.count_as_gguf_blocks(GgmlType::Q4_K);
  EXPECT_TRUE(spec.quantized);
  EXPECT_EQ(spec.full_bytes(), 3072 * 12 * 144);
  EXPECT_EQ(spec.bytes_on_rank(1), 3072 * 3 * 144);
  GgufTensorInfo info;
  info.name = spec.parameter;
  info.type = GgmlType::Q4_K;
  info.dims = {3072, 3072};
  EXPECT_EQ(spec.bytes_on_rank(1), nn::gguf_linear_rank_bytes(info, nn::LinearParallel::Rowwise, 4));
}

}  // namespace
}  // namespace test_gguf
}  // namespace shardit::io
