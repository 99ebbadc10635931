// nn::Module beyond parameters: buffers (persistent and not), keep-in-fp32 modules, checkpoint key
// aliases (tied weights), ignored checkpoint keys, and the forward observer that names emitted
// tensors by module path.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardit/io/safetensors.h"
#include "shardit/nn/embedding.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/test_support.h"

namespace test_module {
namespace {

using shardit::nn::Linear;
using shardit::nn::LinearOptions;
using shardit::parallel::ModelTraits;
using shardit::parallel::TensorParallelModule;
using shardit::parallel::TpPlan;
using shardit::testing::error_of;

/// A BatchNorm-like module: persistent running statistics, a non-persistent computed table.
class Stats : public shardit::nn::Module {
 public:
  Stats() {
    register_buffer("running_mean", &running_mean, {4});
    register_buffer("running_var", &running_var, {4});
    register_buffer("table", &table, {3}, /*persistent=*/false, at::arange(3, at::kFloat));
  }
  std::string type_name() const override { return "Stats"; }
  at::Tensor running_mean, running_var, table;
};

/// An encoder with tied embeddings (T5's `shared` / `encoder.embed_tokens`), a norm kept in fp32,
/// and a statistics module.
class Encoder : public TensorParallelModule {
 public:
  Encoder() {
    shared = register_module("shared", std::make_shared<shardit::nn::Embedding>(10, 4));
    proj = register_module("proj", std::make_shared<Linear>(LinearOptions(4, 4)));
    final_norm = register_module("final_norm", std::make_shared<Linear>(LinearOptions(4, 4)));
    stats = register_module("stats", std::make_shared<Stats>());
  }
  std::string type_name() const override { return "Encoder"; }
  const TpPlan& tp_plan() const override {
    static const TpPlan plan;
    return plan;
  }
  ModelTraits traits() const override {
    ModelTraits traits;
    traits.keep_in_fp32_modules = {"final_norm"};
    traits.key_aliases = {{"shared.weight", {"encoder.embed_tokens.weight"}}};
    traits.ignored_checkpoint_keys = {"lm_head.*"};
    return traits;
  }
  void emit_something(const at::Tensor& value) {
    emit("top", value);
    proj->emit("inner", value);
  }
  std::shared_ptr<shardit::nn::Embedding> shared;
  std::shared_ptr<Linear> proj, final_norm;
  std::shared_ptr<Stats> stats;
};

std::vector<std::pair<std::string, at::Tensor>> checkpoint_tensors(const std::string& embedding_key) {
  return {{embedding_key, at::randn({10, 4})},
          {"proj.weight", at::randn({4, 4})},
          {"proj.bias", at::randn({4})},
          {"final_norm.weight", at::randn({4, 4})},
          {"final_norm.bias", at::randn({4})},
          {"stats.running_mean", at::randn({4})},
          {"stats.running_var", at::rand({4})}};
}

std::string write(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  const std::string path = shardit::testing::make_temp_dir("module") + "/model.safetensors";
  shardit::io::save_safetensors(path, tensors);
  return path;
}

TEST(Module, StateListsParametersThenPersistentBuffers) {
  Encoder model;
  std::vector<std::string> names;
  for (const auto& slot : model.named_states()) names.push_back(slot.name);
  EXPECT_EQ(names, (std::vector<std::string>{"shared.weight", "proj.weight", "proj.bias", "final_norm.weight",
                                             "final_norm.bias", "stats.running_mean", "stats.running_var"}));
  EXPECT_EQ(model.named_buffers().size(), 3u);  // the table too, but it is not state
  EXPECT_TRUE(at::equal(model.stats->table, at::arange(3, at::kFloat)));
}

TEST(Module, LoadsBuffersAndTiedWeightsUnderTheirAlias) {
  const auto tensors = checkpoint_tensors("encoder.embed_tokens.weight");
  Encoder model;
  model.load(shardit::io::Checkpoint::open(write(tensors)), {});
  EXPECT_TRUE(at::equal(model.shared->weight, tensors[0].second));
  EXPECT_TRUE(at::equal(model.stats->running_var, tensors[6].second));
  EXPECT_TRUE(model.is_materialized());
  // The plan kept by the model counts the buffers as replicated state.
  EXPECT_EQ(model.resolved_plan()->spec("stats.running_mean").is_buffer, true);
}

TEST(Module, BothTiedNamesPresentAreAccepted) {
  auto tensors = checkpoint_tensors("shared.weight");
  tensors.emplace_back("encoder.embed_tokens.weight", tensors[0].second);
  tensors.emplace_back("lm_head.weight", at::randn({10, 4}));  // ignored by the model's traits
  Encoder model;
  model.load(shardit::io::Checkpoint::open(write(tensors)), {});
  EXPECT_TRUE(at::equal(model.shared->weight, tensors[0].second));
}

TEST(Module, MissingBufferIsNamed) {
  auto tensors = checkpoint_tensors("shared.weight");
  tensors.pop_back();  // stats.running_var
  const std::string path = write(tensors);
  Encoder model;
  EXPECT_EQ(error_of([&] { model.load(shardit::io::Checkpoint::open(path), {}); }),
            "checkpoint '" + path +
                "' does not fit Encoder: 1 missing weight(s): stats.running_var; check that the checkpoint and the "
                "model config are the same variant");
}

TEST(Module, KeepInFp32ModulesStayFp32) {
  Encoder model;
  shardit::parallel::LoadOptions options;
  options.dtype = at::kBFloat16;
  model.load(shardit::io::Checkpoint::open(write(checkpoint_tensors("shared.weight"))), options);
  EXPECT_EQ(model.proj->weight.scalar_type(), at::kBFloat16);
  EXPECT_EQ(model.final_norm->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(model.stats->running_mean.scalar_type(), at::kBFloat16);
  // Byte counts follow: final_norm in 4 bytes, the rest in 2.
  EXPECT_EQ(model.resolved_plan()->spec("final_norm.weight").element_size, 4);
  EXPECT_EQ(model.resolved_plan()->spec("proj.weight").element_size, 2);
  EXPECT_EQ(model.parameter_bytes(), (10 * 4 + 16 + 4) * 2 + (16 + 4) * 4);
  model.to(at::kCPU, at::kHalf);
  EXPECT_EQ(model.proj->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(model.final_norm->weight.scalar_type(), at::kFloat);
}

TEST(Module, KeepsFp32MatchesWholeSegmentsOnly) {
  EXPECT_TRUE(shardit::nn::keeps_fp32("final_norm.weight", {"final_norm"}));
  EXPECT_TRUE(shardit::nn::keeps_fp32("blocks.0.norm.weight", {"norm"}));
  EXPECT_FALSE(shardit::nn::keeps_fp32("blocks.0.norm1.weight", {"norm"}));
  EXPECT_FALSE(shardit::nn::keeps_fp32("anything", {}));
}

TEST(Module, ObserverReceivesModulePathAndName) {
  Encoder model;
  std::vector<std::pair<std::string, std::string>> seen;
  const at::Tensor value = at::ones({1});
  model.emit_something(value);  // no observer: nothing happens
  {
    const shardit::nn::ObserveForward observe(
        [&](const std::string& path, const std::string& name, const at::Tensor&) { seen.emplace_back(path, name); });
    EXPECT_TRUE(shardit::nn::Module::observed());
    model.emit_something(value);
  }
  EXPECT_FALSE(shardit::nn::Module::observed());
  EXPECT_EQ(seen, (std::vector<std::pair<std::string, std::string>>{{"", "top"}, {"proj", "inner"}}));
  EXPECT_EQ(model.stats->path(), "stats");
}

TEST(Module, ShapeErrorsNameTheModulePath) {
  Encoder model;
  model.load(shardit::io::Checkpoint::open(write(checkpoint_tensors("shared.weight"))), {});
  EXPECT_EQ(error_of([&] { model.proj->forward(at::zeros({2, 3})); }),
            "Linear 'proj' (None): input has 3 features, the weight [4, 4] expects 4");
}

}  // namespace
}  // namespace test_module
