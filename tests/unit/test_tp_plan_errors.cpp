// Every way a plan or a checkpoint can be wrong, and the message that says so. Each message names
// the plan key or tensor, the sizes, and what would work.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardit/core/error.h"
#include "shardit/dist/group.h"
#include "shardit/io/safetensors.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/test_support.h"

namespace test_tp_plan_errors {
namespace {

using shardit::nn::Linear;
using shardit::nn::LinearOptions;
using shardit::nn::Module;
using shardit::nn::ModuleList;
using shardit::parallel::LoadOptions;
using shardit::parallel::ShardStyle;
using shardit::parallel::TensorParallelConfig;
using shardit::parallel::TpDivisor;
using shardit::parallel::TpPlan;
using shardit::testing::error_of;

std::shared_ptr<Linear> linear(int64_t in, int64_t out) {
  return std::make_shared<Linear>(LinearOptions(in, out));
}

class Norm : public Module {
 public:
  Norm() { register_parameter("weight", &weight, {12}); }
  std::string type_name() const override { return "Norm"; }
  at::Tensor weight;
};

class Attention : public Module {
 public:
  Attention() {
    to_q = register_module("to_q", linear(12, 12));
    to_out = register_module("to_out", std::make_shared<ModuleList<Linear>>());
    to_out->push_back(linear(12, 12));
  }
  std::string type_name() const override { return "Attention"; }
  std::shared_ptr<Linear> to_q;
  std::shared_ptr<ModuleList<Linear>> to_out;
};

class Block : public Module {
 public:
  Block() {
    norm = register_module("norm", std::make_shared<Norm>());
    attn = register_module("attn", std::make_shared<Attention>());
    fused = register_module("fused", linear(12, 36));
  }
  std::string type_name() const override { return "Block"; }
  std::shared_ptr<Norm> norm;
  std::shared_ptr<Attention> attn;
  std::shared_ptr<Linear> fused;
};

class Model : public Module {
 public:
  Model() {
    blocks = register_module("blocks", std::make_shared<ModuleList<Block>>());
    blocks->push_back(std::make_shared<Block>());
    blocks->push_back(std::make_shared<Block>());
    proj = register_module("proj", linear(12, 4));
  }
  std::string type_name() const override { return "Model"; }
  std::shared_ptr<ModuleList<Block>> blocks;
  std::shared_ptr<Linear> proj;
};

const TpPlan kPlan = {
    {"blocks.*.attn.to_q", ShardStyle::Colwise},
    {"blocks.*.attn.to_out.0", ShardStyle::Rowwise},
};

std::string resolve_error(const TpPlan& plan, int degree, const std::vector<TpDivisor>& divisors = {}) {
  Model model;
  shardit::parallel::ModelTraits traits;
  traits.divisors = divisors;
  return error_of([&] { shardit::parallel::resolve_plan(model, plan, degree, traits); });
}

TEST(TpPlanErrors, RejectsKeyMatchingNothing) {
  EXPECT_EQ(resolve_error({{"blocks.*.attn.to_qq", ShardStyle::Colwise}}, 2),
            "tp_plan key 'blocks.*.attn.to_qq' matches no module of Model: 'blocks.0.attn' (Attention) has "
            "no child 'to_qq'; its children: to_q, to_out");
  EXPECT_EQ(resolve_error({{"transformer_blocks.*.attn.to_q", ShardStyle::Colwise}}, 2),
            "tp_plan key 'transformer_blocks.*.attn.to_q' matches no module: '<model>' (Model) has no child "
            "'transformer_blocks'; its children: blocks, proj");
  EXPECT_EQ(resolve_error({{"proj.weight", ShardStyle::Colwise}}, 2),
            "tp_plan key 'proj.weight' matches no module of Model: 'proj' (Linear) has no child 'weight'; it "
            "has no children");
}

TEST(TpPlanErrors, RejectsTwoStars) {
  EXPECT_EQ(resolve_error({{"blocks.*.attn.*", ShardStyle::Colwise}}, 2),
            "tp_plan key 'blocks.*.attn.*' has 2 '*': at most one is allowed, standing for the index in one "
            "module list (e.g. 'transformer_blocks.*.attn.to_q')");
}

TEST(TpPlanErrors, RejectsStarInsideASegment) {
  EXPECT_EQ(resolve_error({{"blocks.1*.attn.to_q", ShardStyle::Colwise}}, 2),
            "tp_plan key 'blocks.1*.attn.to_q': '*' must stand for a whole path segment (the index in a "
            "module list), got segment '1*'");
}

TEST(TpPlanErrors, RejectsStarWhosePrefixIsNotAList) {
  EXPECT_EQ(resolve_error({{"blocks.0.*.to_q", ShardStyle::Colwise}}, 2),
            "tp_plan key 'blocks.0.*.to_q': '*' must stand for the index in a module list, but 'blocks.0' is "
            "a Block, not a module list");
}

TEST(TpPlanErrors, RejectsStyleOnModuleWithoutAWeight) {
  EXPECT_EQ(resolve_error({{"blocks.*.norm", ShardStyle::Colwise}}, 2),
            "tp_plan key 'blocks.*.norm' puts a Colwise style on module 'blocks.0.norm', a Norm without a "
            "weight to split: styles apply to Linear and Embedding layers only (remove the key, or name the "
            "layer inside it)");
  EXPECT_EQ(resolve_error({{"blocks.*.attn", ShardStyle::Rowwise}}, 2),
            "tp_plan key 'blocks.*.attn' puts a Rowwise style on module 'blocks.0.attn', a Attention without "
            "a weight to split: styles apply to Linear and Embedding layers only (remove the key, or name the "
            "layer inside it)");
}

TEST(TpPlanErrors, RejectsTwoKeysForOneModule) {
  EXPECT_EQ(resolve_error(
          {{"blocks.*.attn.to_q", ShardStyle::Colwise}, {"blocks.1.attn.to_q", ShardStyle::Rowwise}}, 2),
            "tp_plan keys 'blocks.*.attn.to_q' and 'blocks.1.attn.to_q' both match module "
            "'blocks.1.attn.to_q': each module may have one style");
}

TEST(TpPlanErrors, RejectsIndivisibleDimensionAndListsWorkingDegrees) {
  EXPECT_EQ(resolve_error(kPlan, 5),
            "tp_plan key 'blocks.*.attn.to_q': tensor 'blocks.0.attn.to_q.weight' [12, 12] dim 0 has size "
            "12, which does not divide by tp_degree 5; degrees that would work (up to 64): 1, 2, 3, 4, 6, 12");
  // The list covers every size the plan shards: here blocks 12 and 24 of a 36-row fused layer.
  EXPECT_EQ(resolve_error({{"blocks.*.fused", ShardStyle::PackedColwise, {1, 2}}}, 8),
            "tp_plan key 'blocks.*.fused': tensor 'blocks.0.fused.weight' [36, 12] dim 0 block 0 of 2 [12, "
            "24] has size 12, which does not divide by tp_degree 8; degrees that would work (up to 64): 1, "
            "2, 3, 4, 6, 12");
}

TEST(TpPlanErrors, RejectsIndivisibleDivisor) {
  // 12-wide layers would split 4 ways, but 6 heads do not.
  EXPECT_EQ(resolve_error(kPlan, 4, {{"num_attention_heads", 6}}),
            "num_attention_heads = 6, which does not divide by tp_degree 4; degrees that would work (up to "
            "64): 1, 2, 3, 6");
}

TEST(TpPlanErrors, RejectsDegreeBelowOne) {
  EXPECT_EQ(resolve_error(kPlan, 0),
            "tensor parallel: tp_degree must be >= 1, got 0");
}

TEST(TpPlanErrors, RejectsPackedStyleWithoutBlocks) {
  EXPECT_EQ(resolve_error({{"blocks.*.fused", ShardStyle::PackedColwise}}, 2),
            "tp_plan key 'blocks.*.fused' (PackedColwise) gives no blocks and the layer 'blocks.0.fused' "
            "declares no out_blocks: give the block proportions in the plan entry or declare "
            "LinearOptions::out_blocks");
  EXPECT_EQ(resolve_error({{"blocks.*.fused", ShardStyle::PackedRowwise}}, 2),
            "tp_plan key 'blocks.*.fused' (PackedRowwise) gives no blocks and the layer 'blocks.0.fused' "
            "declares no in_blocks: give the block proportions in the plan entry or declare "
            "LinearOptions::in_blocks");
}

TEST(TpPlanErrors, RejectsProportionsThatDoNotDivideTheDimension) {
  EXPECT_EQ(resolve_error({{"blocks.*.fused", ShardStyle::PackedColwise, {1, 4}}}, 1),
            "tp_plan key 'blocks.*.fused': block proportions [1, 4] (sum 5) do not divide dim 0 of "
            "'blocks.0.fused.weight' (size 36); give proportions whose sum divides 36, or leave them empty "
            "and declare LinearOptions::out_blocks on the layer");
}

TEST(TpPlanErrors, RejectsBlocksOnAPlainStyle) {
  EXPECT_EQ(resolve_error({{"blocks.*.fused", ShardStyle::Colwise, {1, 2}}}, 2),
            "tp_plan key 'blocks.*.fused': blocks [1, 2] are given for the Colwise style; only "
            "PackedColwise, PackedRowwise and ColwiseGather take blocks");
}

TEST(TpPlanErrors, RejectsApplyingToAnUnloadedModel) {
  Model model;
  const std::string message = error_of([&] {
    shardit::parallel::apply_tensor_parallel(model, kPlan,
                                             TensorParallelConfig(shardit::dist::Group::single()));
  });
  EXPECT_EQ(message,
            "apply_tensor_parallel: parameter 'blocks.0.norm.weight' is not loaded; load the weights first, "
            "or shard while loading (load_weights with LoadOptions::tensor_parallel)");
}

TEST(TpPlanErrors, RejectsShardingTwice) {
  Model model;
  shardit::nn::init_random(model, 3);
  const TensorParallelConfig config(shardit::dist::Group::single());
  shardit::parallel::apply_tensor_parallel(model, kPlan, config);
  EXPECT_EQ(error_of([&] { shardit::parallel::apply_tensor_parallel(model, kPlan, config); }),
            "tp_plan key 'blocks.*.attn.to_q': module 'blocks.0.attn.to_q' is already parallel; a model can "
            "be sharded once");
}

// A checkpoint of the model's full tensors, edited by `edit` before saving.
std::string save_checkpoint(
    const std::string& tag,
    const std::function<void(std::vector<std::pair<std::string, at::Tensor>>&)>& edit) {
  Model model;
  shardit::nn::init_random(model, 11);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto& slot : model.named_parameters()) tensors.emplace_back(slot.name, *slot.tensor);
  edit(tensors);
  const std::string path = shardit::testing::make_temp_dir(tag) + "/model.safetensors";
  shardit::io::save_safetensors(path, tensors);
  return path;
}

std::string load_error(const std::string& path, bool parallel) {
  const auto checkpoint = shardit::io::Checkpoint::open(path);
  Model model;
  LoadOptions options;
  if (parallel) options.tensor_parallel = TensorParallelConfig(shardit::dist::Group::single());
  const std::string message =
      error_of([&] { shardit::parallel::load_weights(model, checkpoint, kPlan, options); });
  // Validation happens before anything is read.
  EXPECT_EQ(checkpoint.stats().bytes_read.load(), 0u);
  EXPECT_FALSE(model.is_materialized());
  return message;
}

/// The message of a checkpoint at `path` that does not fit Model.
std::string does_not_fit(const std::string& path, const std::string& problem) {
  return "checkpoint '" + path + "' does not fit Model: " + problem +
         "; check that the checkpoint and the model config are the same variant";
}

TEST(TpPlanErrors, LoadRejectsMissingWeights) {
  const std::string path = save_checkpoint("tp_missing", [](auto& tensors) {
    tensors.erase(tensors.begin() + 2);  // blocks.0.attn.to_q.bias
  });
  for (bool parallel : {false, true}) {
    EXPECT_EQ(load_error(path, parallel), does_not_fit(path, "1 missing weight(s): blocks.0.attn.to_q.bias"));
  }
}

TEST(TpPlanErrors, LoadListsAtMostTenNames) {
  const std::string path = save_checkpoint(
      "tp_many_missing", [](auto& tensors) { tensors.erase(tensors.begin(), tensors.begin() + 12); });
  EXPECT_EQ(load_error(path, true),
            does_not_fit(path,
                         "12 missing weight(s): blocks.0.norm.weight, blocks.0.attn.to_q.weight, "
                         "blocks.0.attn.to_q.bias, blocks.0.attn.to_out.0.weight, blocks.0.attn.to_out.0.bias, "
                         "blocks.0.fused.weight, blocks.0.fused.bias, blocks.1.norm.weight, "
                         "blocks.1.attn.to_q.weight, blocks.1.attn.to_q.bias, ... (2 more)"));
}

TEST(TpPlanErrors, LoadRejectsExtraWeights) {
  const std::string path = save_checkpoint("tp_extra", [](auto& tensors) {
    tensors.emplace_back("blocks.0.attn.to_k.weight", at::zeros({12, 12}));
  });
  for (bool parallel : {false, true}) {
    EXPECT_EQ(load_error(path, parallel),
              does_not_fit(path, "1 unexpected weight(s) not in the model: blocks.0.attn.to_k.weight"));
  }
}

TEST(TpPlanErrors, LoadRejectsMisshapedWeights) {
  const std::string path = save_checkpoint("tp_shape", [](auto& tensors) {
    for (auto& [name, tensor] : tensors) {
      if (name == "blocks.1.attn.to_out.0.weight") tensor = at::zeros({12, 10});
    }
  });
  for (bool parallel : {false, true}) {
    EXPECT_EQ(load_error(path, parallel),
              does_not_fit(path, "1 shape mismatch(es): " + path +
                                     ": tensor 'blocks.1.attn.to_out.0.weight' has shape [12, 10], the model "
                                     "expects [12, 12]"));
  }
}

TEST(TpPlanErrors, LoadValidatesThePlanBeforeReading) {
  const std::string path = save_checkpoint("tp_plan_first", [](auto&) {});
  const auto checkpoint = shardit::io::Checkpoint::open(path);
  Model model;
  LoadOptions options;
  options.tensor_parallel = TensorParallelConfig(shardit::dist::Group::single());
  const TpPlan bad = {{"blocks.*.norm", ShardStyle::Colwise}};
  EXPECT_EQ(error_of([&] { shardit::parallel::load_weights(model, checkpoint, bad, options); }),
            "tp_plan key 'blocks.*.norm' puts a Colwise style on module 'blocks.0.norm', a Norm without a "
            "weight to split: styles apply to Linear and Embedding layers only (remove the key, or name the layer "
            "inside it)");
  EXPECT_EQ(checkpoint.stats().bytes_read.load(), 0u);
  // And a good load afterwards works.
  shardit::parallel::load_weights(model, checkpoint, kPlan, options);
  EXPECT_TRUE(model.is_materialized());
}

}  // namespace
}  // namespace test_tp_plan_errors
