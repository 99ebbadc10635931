// Parallel styles beyond the transformers' Linears, in real multi-process groups: vocab-parallel
// and column-split embeddings (any degree, uneven vocabularies), attention with separate query and
// key/value head counts (GQA), and a TP degree smaller than the world on a 2 x 2 mesh.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/models/registry.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/embedding.h"
#include "shardit/nn/linear.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/verify/transformer_case.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_tp_layers {
namespace {

using shardit::nn::Embedding;
using shardit::nn::Linear;
using shardit::nn::LinearOptions;
using shardit::parallel::ParallelDims;
using shardit::parallel::LoadOptions;
using shardit::parallel::ModelTraits;
using shardit::parallel::ShardStyle;
using shardit::parallel::TensorParallelConfig;
using shardit::parallel::TensorParallelModule;
using shardit::parallel::TpPlan;
using shardit::testing::env_or;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using ::testing::HasSubstr;

// fp32: TP changes only the order of summation; a wrong shard or head mapping gives O(1) errors.
constexpr double kTolerance = 1e-5;

/// Token embeddings and a projection: tok [V, E] with the plan's embedding style, then a colwise
/// and a rowwise Linear so the embedding output feeds real parallel layers.
class EmbeddingToy : public TensorParallelModule {
 public:
  EmbeddingToy(int64_t vocab, int64_t dim, ShardStyle style) : style_(style) {
    tok = register_module("tok", std::make_shared<Embedding>(vocab, dim));
    up = register_module("up", std::make_shared<Linear>(LinearOptions(dim, 4 * dim)));
    down = register_module("down", std::make_shared<Linear>(LinearOptions(4 * dim, dim)));
  }
  std::string type_name() const override { return "EmbeddingToy"; }
  const TpPlan& tp_plan() const override {
    plan_ = {{"tok", style_}, {"up", ShardStyle::Colwise}, {"down", ShardStyle::Rowwise}};
    return plan_;
  }
  /// ids [B, S] -> [B, S, E]
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor x = tok->forward(ids);
    if (tok->parallel_mode() == shardit::nn::EmbeddingParallel::Colwise) {
      // A local column slice: only a rowwise consumer could take it; gather it here instead.
      x = parallel_config()->group->all_gather(x, -1);
    }
    return down->forward(at::gelu(up->forward(x)));
  }
  std::shared_ptr<Embedding> tok;
  std::shared_ptr<Linear> up, down;

 private:
  ShardStyle style_;
  mutable TpPlan plan_;
};

/// Grouped-query attention (Llama/Qwen style): `heads` query heads share `kv_heads` key/value
/// heads, each key/value head serving heads / kv_heads consecutive query heads.
class GqaToy : public TensorParallelModule {
 public:
  GqaToy(int64_t dim, int64_t heads, int64_t kv_heads, int64_t head_dim)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {
    q_proj = register_module("q_proj", std::make_shared<Linear>(LinearOptions(dim, heads * head_dim)));
    k_proj = register_module("k_proj", std::make_shared<Linear>(LinearOptions(dim, kv_heads * head_dim)));
    v_proj = register_module("v_proj", std::make_shared<Linear>(LinearOptions(dim, kv_heads * head_dim)));
    o_proj = register_module("o_proj", std::make_shared<Linear>(LinearOptions(heads * head_dim, dim).with_bias(false)));
  }
  std::string type_name() const override { return "GqaToy"; }
  const TpPlan& tp_plan() const override {
    static const TpPlan plan = {{"q_proj", ShardStyle::Colwise},
                                {"k_proj", ShardStyle::Colwise},
                                {"v_proj", ShardStyle::Colwise},
                                {"o_proj", ShardStyle::Rowwise}};
    return plan;
  }
  ModelTraits traits() const override {
    ModelTraits traits;
    traits.divisors = {{"num_attention_heads", heads_}, {"num_key_value_heads", kv_heads_}};
    return traits;
  }
  /// x [B, S, D] -> [B, S, D]
  at::Tensor forward(const at::Tensor& x) {
    // [B, S, H_local, hd] and [B, S, KV_local, hd]
    const at::Tensor q = shardit::nn::split_heads(q_proj->forward(x), head_dim_);
    at::Tensor k = shardit::nn::split_heads(k_proj->forward(x), head_dim_);
    at::Tensor v = shardit::nn::split_heads(v_proj->forward(x), head_dim_);
    // Each local key/value head serves its group of local query heads: [B, S, H_local, hd]
    const int64_t group = q.size(2) / k.size(2);
    k = k.repeat_interleave(group, 2);
    v = v.repeat_interleave(group, 2);
    const at::Tensor attended = shardit::nn::attention({q, k, v}, nullptr);  // [B, S, H_local * hd]
    return o_proj->forward(attended);
  }
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;

 private:
  int64_t heads_, kv_heads_, head_dim_;
};

std::map<std::string, std::string> case_env(const std::string& dir, const std::string& kind) {
  return {{"TP_LAYERS_DIR", dir}, {"TP_LAYERS_KIND", kind}};
}

ShardStyle embedding_style(const std::string& kind) {
  return kind == "vocab" ? ShardStyle::Rowwise : kind == "colwise" ? ShardStyle::Colwise : ShardStyle::ColwiseGather;
}

std::unique_ptr<TensorParallelModule> make_model(const std::string& kind) {
  if (kind == "gqa") return std::make_unique<GqaToy>(32, 8, 2, 4);
  // 50 tokens: uneven over 3 and 4 ranks.
  return std::make_unique<EmbeddingToy>(50, 12, embedding_style(kind));
}

at::Tensor run(TensorParallelModule& model, const at::Tensor& input) {
  if (auto* gqa = dynamic_cast<GqaToy*>(&model)) return gqa->forward(input);
  return dynamic_cast<EmbeddingToy&>(model).forward(input);
}

/// Parent: random weights, an input and the single-rank output, written for the workers.
std::string prepare(const std::string& kind, uint64_t seed) {
  const std::string dir = shardit::testing::make_temp_dir("tp_layers");
  auto model = make_model(kind);
  shardit::nn::init_random(*model, seed);
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& slot : model->named_states()) weights.emplace_back(slot.name, *slot.tensor);
  shardit::io::save_safetensors(dir + "/model.safetensors", weights);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
  const at::Tensor input =
      kind == "gqa" ? at::normal(0.0, 1.0, {2, 7, 32}, generator)
                    : at::randint(0, 50, {2, 9}, generator, at::TensorOptions().dtype(at::kLong));
  const at::Tensor output = run(*model, input);
  shardit::io::save_safetensors(dir + "/case.safetensors", {{"input", input}, {"output", output}});
  return dir;
}

/// Worker: both load paths at the world's degree reproduce the single-rank output.
void worker() {
  auto& world = shardit::dist::World::init();
  const std::string dir = env_or("TP_LAYERS_DIR");
  const std::string kind = env_or("TP_LAYERS_KIND");
  const auto data = shardit::io::SafetensorsFile::open(dir + "/case.safetensors");
  const at::Tensor input = data->read("input");
  const at::Tensor expected = data->read("output");
  const TensorParallelConfig tp = shardit::testing::world_tensor_parallel();

  auto sharded = make_model(kind);
  LoadOptions options;
  options.tensor_parallel = tp;
  sharded->load(shardit::io::Checkpoint::open(dir + "/model.safetensors"), options);
  auto in_memory = make_model(kind);
  in_memory->load(shardit::io::Checkpoint::open(dir + "/model.safetensors"), {});
  in_memory->enable_parallelism(tp);

  const double atol = kTolerance * std::max(1.0, expected.abs().max().item<double>());
  for (TensorParallelModule* model : {sharded.get(), in_memory.get()}) {
    EXPECT_TRUE(shardit::testing::tensors_close(kind + " at TP=" + std::to_string(world.size()) + " rank " +
                                                    std::to_string(world.rank()),
                                                run(*model, input), expected, atol, 0));
    EXPECT_EQ(model->parameter_bytes(), model->resolved_plan()->bytes_on_rank(world.rank()));
  }
}

TEST(TpLayers, VocabParallelEmbeddingTp2) {
  if (is_worker()) return worker();
  EXPECT_EQ(run_ranks(2, case_env(prepare("vocab", 11), "vocab")), 0);
}

TEST(TpLayers, VocabParallelEmbeddingTp3Uneven) {
  if (is_worker()) return worker();
  EXPECT_EQ(run_ranks(3, case_env(prepare("vocab", 12), "vocab")), 0);
}

TEST(TpLayers, ColwiseGatherEmbeddingTp3) {
  if (is_worker()) return worker();
  EXPECT_EQ(run_ranks(3, case_env(prepare("gather", 13), "gather")), 0);
}

TEST(TpLayers, ColwiseEmbeddingTp2) {
  if (is_worker()) return worker();
  EXPECT_EQ(run_ranks(2, case_env(prepare("colwise", 14), "colwise")), 0);
}

TEST(TpLayers, GqaEightQueryTwoKeyValueHeadsTp2) {
  if (is_worker()) return worker();
  EXPECT_EQ(run_ranks(2, case_env(prepare("gqa", 15), "gqa")), 0);
}

TEST(TpLayers, GqaTp4IsRefusedListingDegrees) {
  GqaToy model(32, 8, 2, 4);
  const std::string message = shardit::testing::error_of([&] { model.resolve(4); });
  EXPECT_EQ(message,
            "num_key_value_heads = 2, which does not divide by tp_degree 4; degrees that would work (up to 64): 1, 2");
}

TEST(TpLayers, EmbeddingRefusesPackedStyles) {
  EmbeddingToy model(50, 12, ShardStyle::PackedColwise);
  EXPECT_EQ(shardit::testing::error_of([&] { model.resolve(2); }),
            "tp_plan key 'tok' puts PackedColwise on the Embedding 'tok'; embeddings take Rowwise (vocabulary "
            "split), Colwise or ColwiseGather (embedding dim split)");
}

TEST(TpLayers, VocabParallelRangesCoverTheVocabularyUnevenly) {
  EmbeddingToy model(50, 12, ShardStyle::Rowwise);
  const auto plan = model.resolve(4);
  const auto& spec = plan.spec("tok.weight");
  ASSERT_EQ(spec.ranges_per_rank.size(), 4u);
  // ceil(50 / 4) = 13 rows each, the last rank the remaining 11.
  EXPECT_EQ(spec.local_shape(0), (std::vector<int64_t>{13, 12}));
  EXPECT_EQ(spec.local_shape(3), (std::vector<int64_t>{11, 12}));
  EXPECT_EQ(spec.ranges_per_rank[3][0].begin, 39);
  EXPECT_EQ(spec.ranges_per_rank[3][0].end, 50);
}

// The built-in model at TP=2 inside a 4-rank world: a 2 x 2 (replica x tp) mesh, each replica a
// sharded copy; every rank must give the single-rank sample.
TEST(TpLayers, BuiltinModelTp2InsideFourRanks) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    const TensorParallelConfig tp = ParallelDims{1, 1, 1, 2}.build(world).tensor_parallel().value();
    EXPECT_EQ(tp.tp_degree(), 2);
    EXPECT_EQ(tp.tp_rank(), world.rank() % 2);
    ASSERT_NE(tp.mesh, nullptr);
    EXPECT_EQ(tp.mesh->to_string(), "replica=2 x cfg=1 x ulysses=1 x ring=1 x tp=2");
    const auto folder = shardit::io::open_component(env_or("TP_LAYERS_MODEL"), "transformer");
    auto model = shardit::models::create_transformer(folder);
    LoadOptions options;
    options.tensor_parallel = tp;
    model->load(folder.weights(), options);
    const at::Tensor sample = shardit::verify::forward_from_file(
        *model, *shardit::io::SafetensorsFile::open(env_or("TP_LAYERS_INPUTS") + "/inputs.safetensors"));
    const at::Tensor expected = shardit::io::SafetensorsFile::open(env_or("TP_LAYERS_REFERENCE"))->read("sample");
    const double atol = kTolerance * std::max(1.0, expected.abs().max().item<double>());
    EXPECT_TRUE(shardit::testing::tensors_close("builtin sample on rank " + std::to_string(world.rank()), sample,
                                                expected, atol, 0));
    EXPECT_EQ(model->resolved_plan()->tp_degree, 2);
    return;
  }
  const auto builtin = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("tp_layers_builtin"));
  const auto folder = shardit::io::open_component(builtin.pipeline, "transformer");
  auto model = shardit::models::create_transformer(folder);
  model->load(folder.weights(), {});
  const std::string reference = shardit::testing::make_temp_dir("tp_layers_ref") + "/reference.safetensors";
  shardit::io::save_safetensors(
      reference, {{"sample", shardit::verify::forward_from_file(
                                 *model, *shardit::io::SafetensorsFile::open(builtin.inputs + "/inputs.safetensors"))}});
  EXPECT_EQ(run_ranks(4, 
                      {{"TP_LAYERS_MODEL", builtin.pipeline},
                       {"TP_LAYERS_INPUTS", builtin.inputs},
                       {"TP_LAYERS_REFERENCE", reference}}),
            0);
}

}  // namespace
}  // namespace test_tp_layers
