// A checkpoint under a key mapping (io::Checkpoint::with_mapping): renames, fused tensors split
// by rows, swapped halves; sliced reads copy only the requested rows of each piece.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "shardit/io/safetensors.h"
#include "support/test_support.h"

namespace shardit::io {
namespace test_checkpoint_mapping {
namespace {

using ::testing::HasSubstr;

struct Fused {
  Checkpoint source;
  at::Tensor qkv;   // [12, 5]: q rows 0-3, k 4-7, v 8-11
  at::Tensor mod;   // [6, 5]: [shift | scale], read as [scale | shift]
  at::Tensor bias;  // [12]
};

Fused write_fused() {
  const std::string path = testing::make_temp_dir("mapping") + "/fused.safetensors";
  Fused fused;
  fused.qkv = at::arange(60, at::kFloat).reshape({12, 5});
  fused.mod = at::arange(30, at::kFloat).reshape({6, 5}) + 1000;
  fused.bias = at::arange(12, at::kFloat) - 50;
  save_safetensors(path, {{"blk.qkv.weight", fused.qkv}, {"blk.qkv.bias", fused.bias}, {"final.mod", fused.mod},
                          {"other", at::ones({2})}});
  fused.source = Checkpoint::open(path);
  return fused;
}

KeyMapping qkv_mapping() {
  return {
      {"attn.to_q.weight", {{"blk.qkv.weight", Range{0, 4}}}},
      {"attn.to_k.weight", {{"blk.qkv.weight", Range{4, 8}}}},
      {"attn.to_v.weight", {{"blk.qkv.weight", Range{8, 12}}}},
      {"attn.to_v.bias", {{"blk.qkv.bias", Range{8, 12}}}},
      {"norm_out.linear.weight", {{"final.mod", Range{3, 6}}, {"final.mod", Range{0, 3}}}},
      {"renamed", {{"other", std::nullopt}}},
  };
}

TEST(CheckpointMapping, ReadsRenamedSplitAndSwappedTensors) {
  const Fused fused = write_fused();
  const Checkpoint mapped = fused.source.with_mapping(qkv_mapping());
  EXPECT_TRUE(mapped.mapped());
  EXPECT_EQ(mapped.names().size(), 6u);
  EXPECT_FALSE(mapped.contains("blk.qkv.weight"));
  EXPECT_EQ(mapped.info("attn.to_k.weight").shape, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(mapped.info("attn.to_k.weight").nbytes(), 4u * 5 * 4);
  EXPECT_TRUE(at::equal(mapped.read("attn.to_k.weight"), fused.qkv.slice(0, 4, 8)));
  EXPECT_TRUE(at::equal(mapped.read("attn.to_v.bias"), fused.bias.slice(0, 8, 12)));
  EXPECT_TRUE(at::equal(mapped.read("norm_out.linear.weight"),
                        at::cat({fused.mod.slice(0, 3, 6), fused.mod.slice(0, 0, 3)}, 0)));
  EXPECT_TRUE(at::equal(mapped.read("renamed"), at::ones({2})));
  EXPECT_EQ(mapped.file_of("attn.to_q.weight").path(), fused.source.path());
  // Rows across the swap: [2, 4) of [scale | shift] are scale's last row and shift's first.
  EXPECT_TRUE(at::equal(mapped.read_slices("norm_out.linear.weight", 0, {{2, 4}}),
                        at::cat({fused.mod.slice(0, 5, 6), fused.mod.slice(0, 0, 1)}, 0)));
  // Columns of a split piece.
  EXPECT_TRUE(at::equal(mapped.read_slices("attn.to_v.weight", 1, {{1, 3}}), fused.qkv.slice(0, 8, 12).slice(1, 1, 3)));
  // Converted on read.
  EXPECT_EQ(mapped.read("attn.to_q.weight", at::kDouble).scalar_type(), at::kDouble);
}

TEST(CheckpointMapping, RankSlicesReadOnlyTheirRows) {
  const Fused fused = write_fused();
  const Checkpoint mapped = fused.source.with_mapping(qkv_mapping());
  auto& stats = const_cast<ReadStats&>(mapped.stats());
  // Rank 1 of 2 of each of q, k, v: rows [2, 4) of each third, 6 of the fused tensor's 12 rows.
  stats.bytes_read = 0;
  for (const char* name : {"attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"}) {
    const at::Tensor slice = mapped.read_slices(name, 0, {{2, 4}});
    EXPECT_EQ(slice.size(0), 2);
  }
  EXPECT_EQ(stats.bytes_read.load(), fused.qkv.nbytes() / 2);
  EXPECT_TRUE(at::equal(mapped.read_slices("attn.to_k.weight", 0, {{2, 4}}), fused.qkv.slice(0, 6, 8)));
  // The stats are the source's: one count for the file, mapped or not.
  EXPECT_EQ(&mapped.stats(), &fused.source.stats());
}

TEST(CheckpointMapping, RefusesBadPiecesNamingThem) {
  const Fused fused = write_fused();
  EXPECT_THAT(testing::error_of([&] { fused.source.with_mapping({{"a", {{"absent", std::nullopt}}}}); }),
              HasSubstr("'a' is read from tensor 'absent', which the file does not hold"));
  EXPECT_THAT(testing::error_of([&] { fused.source.with_mapping({{"a", {{"blk.qkv.weight", Range{8, 13}}}}}); }),
              HasSubstr("reads rows [8, 13) of tensor 'blk.qkv.weight', which has 12 rows"));
  EXPECT_THAT(testing::error_of([&] {
                fused.source.with_mapping({{"a", {{"blk.qkv.weight", Range{0, 2}}, {"blk.qkv.bias", Range{0, 2}}}}});
              }),
              HasSubstr("differ in dtype or row shape"));
  const Checkpoint mapped = fused.source.with_mapping(qkv_mapping());
  EXPECT_THAT(testing::error_of([&] { mapped.read("blk.qkv.weight"); }),
              HasSubstr("no tensor mapped to 'blk.qkv.weight'"));
  EXPECT_THAT(testing::error_of([&] { mapped.read_slices("attn.to_q.weight", 0, {{3, 5}}); }),
              HasSubstr("outside its dim 0 of size 4"));
  EXPECT_THAT(testing::error_of([&] { mapped.with_mapping(qkv_mapping()); }), HasSubstr("already mapped"));
}

}  // namespace
}  // namespace test_checkpoint_mapping
}  // namespace shardit::io
