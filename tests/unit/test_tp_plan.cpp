// The plan resolver and sharder in one process: glob matching, the ShardSpec of every style,
// byte accounting and shard_tensor at fake degrees (no group needed), and the in-memory path at
// degree 1 with a size-1 group.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "shardit/dist/group.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/test_support.h"

namespace test_tp_plan {
namespace {

using shardit::io::Range;
using shardit::nn::Linear;
using shardit::nn::LinearOptions;
using shardit::nn::LinearParallel;
using shardit::nn::Module;
using shardit::nn::ModuleList;
using shardit::parallel::ShardSpec;
using shardit::parallel::ShardStyle;
using shardit::parallel::TpPlan;
using ::testing::HasSubstr;

constexpr int64_t kDim = 24;

std::shared_ptr<Linear> linear(int64_t in, int64_t out) {
  return std::make_shared<Linear>(LinearOptions(in, out));
}

class ToyNorm : public Module {
 public:
  ToyNorm() { register_parameter("weight", &weight, {kDim}); }
  std::string type_name() const override { return "ToyNorm"; }
  at::Tensor weight;
};

class ToyAttention : public Module {
 public:
  ToyAttention() {
    to_q = register_module("to_q", linear(kDim, kDim));
    to_k = register_module("to_k", linear(kDim, kDim));
    to_out = register_module("to_out", std::make_shared<ModuleList<Linear>>());
    to_out->push_back(linear(kDim, kDim));
  }
  std::string type_name() const override { return "ToyAttention"; }
  std::shared_ptr<Linear> to_q, to_k;
  std::shared_ptr<ModuleList<Linear>> to_out;
};

class ToyBlock : public Module {
 public:
  ToyBlock() {
    norm = register_module("norm", std::make_shared<ToyNorm>());
    attn = register_module("attn", std::make_shared<ToyAttention>());
    // Fused projection with proportions 1:1:1:3:3 of 9 * 24 = 216 rows.
    fused = register_module("fused", linear(kDim, 9 * kDim));
    qkv = register_module(
        "qkv", std::make_shared<Linear>(LinearOptions(kDim, 3 * kDim).with_out_blocks({kDim, kDim, kDim})));
    proj_out = register_module(
        "proj_out",
        std::make_shared<Linear>(LinearOptions(kDim + 4 * kDim, kDim).with_in_blocks({kDim, 4 * kDim})));
    modulation = register_module("modulation", linear(kDim, 6 * kDim));
  }
  std::string type_name() const override { return "ToyBlock"; }
  std::shared_ptr<ToyNorm> norm;
  std::shared_ptr<ToyAttention> attn;
  std::shared_ptr<Linear> fused, qkv, proj_out, modulation;
};

class ToyModel : public Module {
 public:
  explicit ToyModel(int blocks = 2) {
    embed = register_module("embed", linear(8, kDim));
    this->blocks = register_module("blocks", std::make_shared<ModuleList<ToyBlock>>());
    for (int i = 0; i < blocks; ++i) this->blocks->push_back(std::make_shared<ToyBlock>());
  }
  std::string type_name() const override { return "ToyModel"; }
  std::shared_ptr<Linear> embed;
  std::shared_ptr<ModuleList<ToyBlock>> blocks;
};

TpPlan full_plan() {
  return {
      {"blocks.*.attn.to_q", ShardStyle::Colwise},
      {"blocks.*.attn.to_k", ShardStyle::Colwise},
      {"blocks.*.attn.to_out.0", ShardStyle::Rowwise},
      {"blocks.*.fused", ShardStyle::PackedColwise, {1, 1, 1, 3, 3}},
      {"blocks.*.qkv", ShardStyle::PackedColwise},
      {"blocks.*.proj_out", ShardStyle::PackedRowwise},
      {"blocks.*.modulation", ShardStyle::ColwiseGather},
  };
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

std::vector<Range> ranges(std::initializer_list<std::pair<int64_t, int64_t>> pairs) {
  std::vector<Range> out;
  for (const auto& [begin, end] : pairs) out.push_back({begin, end});
  return out;
}

TEST(TpPlan, GlobMatchesEveryListElementAndNothingElse) {
  ToyModel model(3);
  const auto plan = shardit::parallel::resolve_plan(model, {{"blocks.*.attn.to_q", ShardStyle::Colwise}}, 2);
  EXPECT_EQ(plan.tp_degree, 2);
  EXPECT_EQ(plan.parameters.size(), model.named_parameters().size());
  int sharded = 0;
  for (const ShardSpec& spec : plan.parameters) {
    const bool is_q = spec.parameter.find(".attn.to_q.") != std::string::npos;
    EXPECT_EQ(spec.is_sharded(), is_q) << spec.parameter;
    EXPECT_EQ(spec.plan_key, is_q ? "blocks.*.attn.to_q" : "") << spec.parameter;
    sharded += spec.is_sharded();
  }
  EXPECT_EQ(sharded, 6);  // weight and bias of 3 blocks
  // Model order is kept.
  auto slots = model.named_parameters();
  for (size_t i = 0; i < slots.size(); ++i) EXPECT_EQ(plan.parameters[i].parameter, slots[i].name);
}

TEST(TpPlan, KeyWithoutStarMatchesOneModule) {
  ToyModel model;
  const auto plan = shardit::parallel::resolve_plan(model, {{"blocks.1.attn.to_k", ShardStyle::Colwise}}, 2);
  EXPECT_TRUE(plan.spec("blocks.1.attn.to_k.weight").is_sharded());
  EXPECT_FALSE(plan.spec("blocks.0.attn.to_k.weight").is_sharded());
}

TEST(TpPlan, ColwiseSplitsWeightAndBiasRows) {
  ToyModel model;
  const auto plan = shardit::parallel::resolve_plan(model, full_plan(), 3);
  const ShardSpec& w = plan.spec("blocks.0.attn.to_q.weight");
  EXPECT_EQ(w.style, ShardStyle::Colwise);
  EXPECT_EQ(w.dim, 0);
  EXPECT_EQ(w.full_shape, (std::vector<int64_t>{kDim, kDim}));
  ASSERT_EQ(w.ranges_per_rank.size(), 3u);
  EXPECT_EQ(w.ranges_per_rank[0], ranges({{0, 8}}));
  EXPECT_EQ(w.ranges_per_rank[1], ranges({{8, 16}}));
  EXPECT_EQ(w.ranges_per_rank[2], ranges({{16, 24}}));
  EXPECT_EQ(w.local_shape(1), (std::vector<int64_t>{8, kDim}));
  const ShardSpec& b = plan.spec("blocks.0.attn.to_q.bias");
  EXPECT_EQ(b.dim, 0);
  EXPECT_EQ(b.ranges_per_rank, w.ranges_per_rank);
  EXPECT_EQ(b.local_shape(2), (std::vector<int64_t>{8}));
}

TEST(TpPlan, RowwiseSplitsWeightColumnsAndReplicatesBias) {
  ToyModel model;
  const auto plan = shardit::parallel::resolve_plan(model, full_plan(), 4);
  const ShardSpec& w = plan.spec("blocks.1.attn.to_out.0.weight");
  EXPECT_EQ(w.style, ShardStyle::Rowwise);
  EXPECT_EQ(w.dim, 1);
  EXPECT_EQ(w.ranges_per_rank[3], ranges({{18, 24}}));
  EXPECT_EQ(w.local_shape(0), (std::vector<int64_t>{kDim, 6}));
  const ShardSpec& b = plan.spec("blocks.1.attn.to_out.0.bias");
  EXPECT_FALSE(b.is_sharded());
  EXPECT_EQ(b.dim, -1);
  EXPECT_FALSE(b.style.has_value());
  EXPECT_EQ(b.plan_key, "blocks.*.attn.to_out.0");
  EXPECT_EQ(b.local_shape(3), (std::vector<int64_t>{kDim}));
}

TEST(TpPlan, PackedColwiseWithProportionsSplitsEachBlock) {
  ToyModel model;
  // 216 rows in proportions 1:1:1:3:3 -> blocks 24, 24, 24, 72, 72; at TP=2 each rank takes half
  // of each.
  const auto plan = shardit::parallel::resolve_plan(model, full_plan(), 2);
  const ShardSpec& w = plan.spec("blocks.0.fused.weight");
  EXPECT_EQ(w.style, ShardStyle::PackedColwise);
  EXPECT_EQ(w.dim, 0);
  EXPECT_EQ(w.ranges_per_rank[0], ranges({{0, 12}, {24, 36}, {48, 60}, {72, 108}, {144, 180}}));
  EXPECT_EQ(w.ranges_per_rank[1], ranges({{12, 24}, {36, 48}, {60, 72}, {108, 144}, {180, 216}}));
  EXPECT_EQ(w.local_shape(1), (std::vector<int64_t>{108, kDim}));
  const ShardSpec& b = plan.spec("blocks.0.fused.bias");
  EXPECT_EQ(b.dim, 0);
  EXPECT_EQ(b.ranges_per_rank, w.ranges_per_rank);
}

TEST(TpPlan, PackedStylesUseLayerDeclaredBlocks) {
  ToyModel model;
  const auto plan = shardit::parallel::resolve_plan(model, full_plan(), 3);
  const ShardSpec& qkv = plan.spec("blocks.0.qkv.weight");
  EXPECT_EQ(qkv.dim, 0);
  EXPECT_EQ(qkv.ranges_per_rank[1], ranges({{8, 16}, {32, 40}, {56, 64}}));
  EXPECT_EQ(plan.spec("blocks.0.qkv.bias").ranges_per_rank[1], qkv.ranges_per_rank[1]);

  const ShardSpec& proj = plan.spec("blocks.0.proj_out.weight");
  EXPECT_EQ(proj.style, ShardStyle::PackedRowwise);
  EXPECT_EQ(proj.dim, 1);
  // in_blocks {24, 96}: rank 2 holds [16, 24) of the first and [24 + 64, 24 + 96) of the second.
  EXPECT_EQ(proj.ranges_per_rank[2], ranges({{16, 24}, {88, 120}}));
  EXPECT_EQ(proj.local_shape(2), (std::vector<int64_t>{kDim, 40}));
  EXPECT_FALSE(plan.spec("blocks.0.proj_out.bias").is_sharded());
}

TEST(TpPlan, ColwiseGatherSplitsContiguously) {
  ToyModel model;
  const auto plan = shardit::parallel::resolve_plan(model, full_plan(), 4);
  const ShardSpec& w = plan.spec("blocks.1.modulation.weight");
  EXPECT_EQ(w.style, ShardStyle::ColwiseGather);
  EXPECT_EQ(w.dim, 0);
  EXPECT_EQ(w.ranges_per_rank[1], ranges({{36, 72}}));
  EXPECT_EQ(plan.spec("blocks.1.modulation.bias").ranges_per_rank[1], ranges({{36, 72}}));
}

TEST(TpPlan, ShardedModulationPrecedesTheReferencePlan) {
  const TpPlan reference = {{"blocks.*.attn.to_q", ShardStyle::Colwise},
                            {"blocks.*.ff.net.0.proj", ShardStyle::PackedColwise, {1, 1}}};
  const TpPlan plan = shardit::parallel::with_sharded_modulation({"blocks.*.modulation", "norm.linear"}, reference);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].pattern, "blocks.*.modulation");
  EXPECT_EQ(plan[0].style, ShardStyle::ColwiseGather);
  EXPECT_TRUE(plan[0].blocks.empty());
  EXPECT_EQ(plan[1].pattern, "norm.linear");
  EXPECT_EQ(plan[1].style, ShardStyle::ColwiseGather);
  EXPECT_EQ(plan[2].pattern, "blocks.*.attn.to_q");
  EXPECT_EQ(plan[3].pattern, "blocks.*.ff.net.0.proj");
  EXPECT_EQ(plan[3].style, ShardStyle::PackedColwise);
  EXPECT_EQ(plan[3].blocks, (std::vector<int64_t>{1, 1}));
}

TEST(TpPlan, UnlistedParametersAreReplicated) {
  ToyModel model;
  const auto plan = shardit::parallel::resolve_plan(model, full_plan(), 2);
  for (const char* name : {"embed.weight", "embed.bias", "blocks.0.norm.weight"}) {
    const ShardSpec& spec = plan.spec(name);
    EXPECT_FALSE(spec.is_sharded()) << name;
    EXPECT_EQ(spec.plan_key, "") << name;
    EXPECT_EQ(spec.local_shape(1), spec.full_shape) << name;
  }
}

TEST(TpPlan, ByteAccounting) {
  ToyModel model;
  int64_t total_elements = 0;
  for (auto& slot : model.named_parameters()) total_elements += slot.tensor->numel();
  for (int degree : {1, 2, 3, 4, 6}) {
    const auto plan = shardit::parallel::resolve_plan(model, full_plan(), degree);
    EXPECT_EQ(plan.replicated_bytes() + plan.sharded_bytes(), total_elements * 4);
    int64_t replicated = 0;
    for (const ShardSpec& spec : plan.parameters) {
      if (!spec.is_sharded()) replicated += 4 * numel_of(spec.full_shape);
    }
    EXPECT_EQ(plan.replicated_bytes(), replicated);
    for (int r = 0; r < degree; ++r) {
      EXPECT_EQ(plan.bytes_on_rank(r), plan.replicated_bytes() + plan.sharded_bytes() / degree) << degree;
    }
  }
  const auto plan = shardit::parallel::resolve_plan(model, full_plan(), 2, {}, at::kBFloat16);
  EXPECT_EQ(plan.replicated_bytes() + plan.sharded_bytes(), total_elements * 2);
}

TEST(TpPlan, ToTableListsEveryParameterAndTotals) {
  ToyModel model;
  const auto plan = shardit::parallel::resolve_plan(model, full_plan(), 2);
  const std::string table = plan.to_table();
  for (const ShardSpec& spec : plan.parameters) EXPECT_THAT(table, HasSubstr(spec.parameter));
  EXPECT_THAT(table, HasSubstr("tp_degree 2"));
  EXPECT_THAT(table, HasSubstr("PackedColwise (dim 0)"));
  EXPECT_THAT(table, HasSubstr("PackedRowwise (dim 1)"));
  EXPECT_THAT(table, HasSubstr("ColwiseGather (dim 0)"));
  EXPECT_THAT(table, HasSubstr("replicated"));
  EXPECT_THAT(table, HasSubstr("replicated: " + std::to_string(plan.replicated_bytes()) + " bytes"));
  EXPECT_THAT(table, HasSubstr("sharded:    " + std::to_string(plan.sharded_bytes()) + " bytes"));
  EXPECT_THAT(table, HasSubstr("per rank:   " + std::to_string(plan.bytes_on_rank(0)) + " bytes"));
}

// Rank shards, put back block by block, give back the full tensor.
TEST(TpPlan, ShardTensorPiecesReassembleTheFullTensor) {
  ToyModel model;
  for (int degree : {1, 2, 3, 4}) {
    const auto plan = shardit::parallel::resolve_plan(model, full_plan(), degree);
    for (const char* name : {"blocks.0.fused.weight", "blocks.0.fused.bias", "blocks.0.proj_out.weight",
                             "blocks.1.qkv.weight", "blocks.0.attn.to_q.weight", "embed.weight"}) {
      const ShardSpec& spec = plan.spec(name);
      const at::Tensor full = at::arange(numel_of(spec.full_shape), at::kFloat).reshape(spec.full_shape);
      at::Tensor rebuilt = at::zeros_like(full);
      int64_t local_bytes = 0;
      for (int r = 0; r < degree; ++r) {
        const at::Tensor local = shard_tensor(full, spec, r);
        EXPECT_EQ(local.sizes().vec(), spec.local_shape(r)) << name;
        EXPECT_TRUE(local.is_contiguous());
        EXPECT_NE(local.data_ptr(), full.data_ptr());
        local_bytes += local.numel() * 4;
        if (!spec.is_sharded()) {
          EXPECT_TRUE(at::equal(local, full));
          continue;
        }
        int64_t offset = 0;
        for (const Range& range : spec.ranges_per_rank[r]) {
          rebuilt.narrow(spec.dim, range.begin, range.size())
              .copy_(local.narrow(spec.dim, offset, range.size()));
          offset += range.size();
        }
      }
      if (spec.is_sharded()) {
        EXPECT_TRUE(at::equal(rebuilt, full)) << name << " at degree " << degree;
        EXPECT_EQ(local_bytes, full.numel() * 4);
      }
    }
  }
}

TEST(TpPlan, ShardTensorTakesTheRanksRowsOfEachBlock) {
  ToyModel model;
  const auto plan = shardit::parallel::resolve_plan(model, full_plan(), 3);
  const ShardSpec& spec = plan.spec("blocks.0.qkv.weight");
  const at::Tensor full = at::randn({3 * kDim, kDim});
  const at::Tensor expected = at::cat({full.slice(0, 8, 16), full.slice(0, 32, 40), full.slice(0, 56, 64)});
  EXPECT_TRUE(at::equal(shard_tensor(full, spec, 1), expected));
}

void fill_random(Module& model, uint64_t seed) { shardit::nn::init_random(model, seed); }

TEST(TpPlan, ApplyAtDegreeOneKeepsOutputsAndSetsModes) {
  ToyModel model;
  fill_random(model, 7);
  const at::Tensor x = at::randn({2, 5, kDim});
  auto& block = model.blocks->operator[](0);
  const at::Tensor q_ref = block.attn->to_q->forward(x);
  const at::Tensor out_ref = (*block.attn->to_out)[0].forward(x);
  const at::Tensor mod_ref = block.modulation->forward(x);
  const at::Tensor expected_out =
      at::linear(x, (*block.attn->to_out)[0].weight, (*block.attn->to_out)[0].bias);
  EXPECT_TRUE(at::equal(out_ref, expected_out));

  auto group = shardit::dist::Group::single();
  const shardit::parallel::TensorParallelConfig config(group);
  EXPECT_EQ(config.tp_degree(), 1);
  EXPECT_EQ(config.tp_rank(), 0);
  shardit::parallel::apply_tensor_parallel(model, full_plan(), config);
  EXPECT_EQ(block.attn->to_q->parallel_mode(), LinearParallel::Colwise);
  EXPECT_EQ(block.qkv->parallel_mode(), LinearParallel::Colwise);
  EXPECT_EQ((*block.attn->to_out)[0].parallel_mode(), LinearParallel::Rowwise);
  EXPECT_EQ(block.proj_out->parallel_mode(), LinearParallel::Rowwise);
  EXPECT_EQ(block.modulation->parallel_mode(), LinearParallel::ColwiseGather);
  EXPECT_EQ(model.embed->parallel_mode(), LinearParallel::None);

  group->stats().reset();
  EXPECT_TRUE(at::equal(block.attn->to_q->forward(x), q_ref));
  EXPECT_TRUE(at::equal((*block.attn->to_out)[0].forward(x), out_ref));
  EXPECT_TRUE(at::equal(block.modulation->forward(x), mod_ref));
  EXPECT_EQ(group->stats().calls_by_op["all_reduce"], 1u);
  EXPECT_EQ(group->stats().calls_by_op["all_gather"], 1u);
}

TEST(TpPlan, ModuleLevelPlanWorksOnTensorParallelModule) {
  class Wrapped : public shardit::parallel::TensorParallelModule {
   public:
    Wrapped() { inner = register_module("inner", std::make_shared<ToyModel>()); }
    std::string type_name() const override { return "Wrapped"; }
    const TpPlan& tp_plan() const override {
      static const TpPlan plan = {{"inner.blocks.*.attn.to_q", ShardStyle::Colwise}};
      return plan;
    }
    shardit::parallel::ModelTraits traits() const override {
      shardit::parallel::ModelTraits traits;
      traits.divisors = {{"heads", 6}};
      return traits;
    }
    std::shared_ptr<ToyModel> inner;
  };
  Wrapped model;
  const auto plan = model.resolve(3);
  EXPECT_TRUE(plan.spec("inner.blocks.0.attn.to_q.weight").is_sharded());
  EXPECT_EQ(shardit::testing::error_of([&] { model.resolve(4); }),
            "heads = 6, which does not divide by tp_degree 4; degrees that would work (up to 64): 1, 2, 3, 6");
  fill_random(model, 1);
  model.enable_parallelism(shardit::parallel::TensorParallelConfig(shardit::dist::Group::single()));
  EXPECT_EQ(model.tp_degree(), 1);
  EXPECT_EQ(model.inner->blocks->operator[](1).attn->to_q->parallel_mode(), LinearParallel::Colwise);
}

}  // namespace
}  // namespace test_tp_plan
