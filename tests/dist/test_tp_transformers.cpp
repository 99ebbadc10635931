// The transformers under real tensor parallelism: ranks at TP=N (separate processes on this host)
// must give the single-rank output, through both load paths (shard while loading; load whole,
// then enable_parallelism). The golden models have 4 heads (TP=2, 4); the built-in tiny model has
// 12 (TP=3, a degree that is not a power of two). FLUX.2's fused projections
// (to_qkv_mlp_proj [q|k|v|gate|up], FF linear_in [gate|up], the single block's to_out over
// [attn|mlp]) are packed: a wrong local split moves values by O(scale).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <string>

#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/registry.h"
#include "shardit/verify/transformer_case.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_tp_transformers {
namespace {

using shardit::parallel::ShardStyle;
using shardit::parallel::TensorParallelModule;
using shardit::parallel::TpPlanKind;
using shardit::testing::env_or;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::load_transformer;
using shardit::testing::run_case;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;
using ::testing::HasSubstr;

// The TP=N sample may differ from TP=1 only by the order of fp32 sums (each rowwise layer adds N
// partial products instead of one dot product), an error that scales with the activations, not
// with each output element: ~1e-7 to 1e-6 of the output's scale. 1e-5 of max|reference| leaves
// room for that and fails on any sharding error, which moves values by O(scale).
constexpr double kTpScaleTolerance = 1e-5;

std::shared_ptr<TensorParallelModule> create(const std::string& model_dir) {
  return shardit::models::create_transformer(shardit::io::open_component(model_dir, "transformer"));
}

/// Worker body: load through `SHARDIT_TP_PATH`, run, compare with the reference written by the
/// parent (TP=1 in this same build), and check each rank holds exactly its share of the bytes.
void tp_worker() {
  auto& world = shardit::dist::World::init();
  const std::string model_dir = env_or("SHARDIT_TP_MODEL");
  const std::string path = env_or("SHARDIT_TP_PATH");
  const TpPlanKind kind = shardit::parallel::parse_tp_plan_kind(env_or("SHARDIT_TP_PLAN"));
  auto model = load_transformer(model_dir, path, kind);
  const at::Tensor sample = run_case(*model, env_or("SHARDIT_TP_INPUTS"));
  const at::Tensor expected = shardit::io::SafetensorsFile::open(env_or("SHARDIT_TP_REFERENCE"))->read("sample");
  const double scale = expected.abs().max().item<double>();
  const auto result = tensors_close(model->type_name() + " sample at TP=" + std::to_string(world.size()) + " (" + path + ")",
                                    sample, expected, kTpScaleTolerance * scale, 0.0);
  EXPECT_TRUE(result);
  if (world.rank() == 0) std::cout << result.message() << " (scale " << scale << ")\n";
  // The plan the model was loaded or sharded with.
  ASSERT_NE(model->resolved_plan(), nullptr);
  const auto& plan = *model->resolved_plan();
  EXPECT_EQ(plan.tp_degree, world.size());
  EXPECT_EQ(plan.plan, kind);
  EXPECT_EQ(model->parameter_bytes(), plan.bytes_on_rank(world.rank()));
  EXPECT_LT(plan.bytes_on_rank(world.rank()), plan.replicated_bytes() + plan.sharded_bytes());
}

/// Parent: the TP=1 reference, computed in this process and written for the workers. Where the
/// case has golden outputs, the reference must match them, so every comparison is anchored to
/// diffusers.
std::string write_reference(const std::string& model_dir, const std::string& inputs_dir) {
  auto model = load_transformer(model_dir);
  const at::Tensor sample = run_case(*model, inputs_dir);
  const std::string golden = inputs_dir + "/outputs.safetensors";
  if (std::filesystem::exists(golden)) {
    EXPECT_TRUE(tensors_close("sample at TP=1", sample, shardit::io::SafetensorsFile::open(golden)->read("sample"),
                              1e-4, 1e-4));
  }
  const std::string path = shardit::testing::make_temp_dir("tp-reference") + "/reference.safetensors";
  shardit::io::save_safetensors(path, {{"sample", sample}});
  return path;
}

/// Runs this test as `nproc` ranks for each load path; each rank runs tp_worker() with the
/// model's `kind` of plan.
void expect_tp_matches(int nproc, const std::string& model_dir, const std::string& inputs_dir,
                       TpPlanKind kind = TpPlanKind::Full) {
  const std::string reference = write_reference(model_dir, inputs_dir);
  for (const std::string path : {"shard-on-load", "enable-parallelism"}) {
    EXPECT_EQ(run_ranks(nproc, {{"SHARDIT_TP_MODEL", model_dir},
                                {"SHARDIT_TP_INPUTS", inputs_dir},
                                {"SHARDIT_TP_PATH", path},
                                {"SHARDIT_TP_PLAN", shardit::parallel::tp_plan_kind_name(kind)},
                                {"SHARDIT_TP_REFERENCE", reference}}),
              0)
        << "TP=" << nproc << " through " << path << ", plan " << shardit::parallel::tp_plan_kind_name(kind);
  }
}

void expect_golden_tp_matches(int nproc, const std::string& golden_case, TpPlanKind kind = TpPlanKind::Full) {
  expect_tp_matches(nproc, golden_path(golden_case), golden_path(golden_case), kind);
}

// ---------------------------------------------------------------------------------------------
// FLUX.1

TEST(TpFlux, GoldenTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "flux_b2_nonsquare");
}

TEST(TpFlux, GoldenTp4MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "flux_b1_square");
}

TEST(TpFlux, GoldenSchnellTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "flux_schnell_b2_nonsquare");
}

TEST(TpFlux, BuiltinTp3MatchesTp1) {
  if (is_worker()) return tp_worker();
  const auto paths = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  expect_tp_matches(3, paths.pipeline, paths.inputs);
}

/// Worker: the collectives of one TP forward, counted on the model's tensor-parallel group (the
/// one its layers use; a group of its own even when it spans the world) against what the plan
/// implies and against FLUX.1's structure: 4 rowwise layers per double block (to_out.0,
/// to_add_out, ff.net.2, ff_context.net.2), 1 per single block (proj_out); 2 ColwiseGather
/// modulations per double block, 1 per single block.
void count_collectives_worker() {
  auto& world = shardit::dist::World::init();
  auto model = load_transformer(env_or("SHARDIT_TP_MODEL"), "shard-on-load");
  const auto* flux = dynamic_cast<const shardit::models::FluxTransformer2DModel*>(model.get());
  ASSERT_NE(flux, nullptr);
  ASSERT_NE(model->parallel_config(), nullptr);
  auto& stats = model->parallel_config()->group->stats();
  stats.reset();
  run_case(*model, env_or("SHARDIT_TP_INPUTS"));
  const int64_t doubles = flux->config.num_layers, singles = flux->config.num_single_layers;
  const auto& plan = *model->resolved_plan();
  EXPECT_EQ(plan.layers_with_style({ShardStyle::Rowwise, ShardStyle::PackedRowwise}), 4 * doubles + singles);
  EXPECT_EQ(plan.layers_with_style({ShardStyle::ColwiseGather}), 2 * doubles + singles);
  EXPECT_EQ(stats.calls_by_op["all_reduce"], static_cast<uint64_t>(4 * doubles + singles));
  EXPECT_EQ(stats.calls_by_op["all_gather"], static_cast<uint64_t>(2 * doubles + singles));
  EXPECT_GT(stats.bytes_sent, 0u);
  EXPECT_EQ(world.size(), model->tp_degree());
}

TEST(TpFlux, GoldenTp2CountsOneAllReducePerRowwiseLayer) {
  if (is_worker()) return count_collectives_worker();
  EXPECT_EQ(run_ranks(2, {{"SHARDIT_TP_MODEL", golden_path("flux_b2_nonsquare")},
                          {"SHARDIT_TP_INPUTS", golden_path("flux_b2_nonsquare")}}),
            0);
}

// ---------------------------------------------------------------------------------------------
// FLUX.2

TEST(TpFlux2, GoldenTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "flux2_b2_nonsquare");
}

TEST(TpFlux2, GoldenTp4MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "flux2_b1_square");
}

TEST(TpFlux2, GoldenKleinTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "flux2_klein_b2_nonsquare");
}

TEST(TpFlux2, GoldenKleinTp4MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "flux2_klein_b2_nonsquare");
}

// ---------------------------------------------------------------------------------------------
// Qwen-Image (the b2 case has padded text tokens: the key mask must survive the head split)

TEST(TpQwenImage, GoldenTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "qwenimage_b2_nonsquare");
}

TEST(TpQwenImage, GoldenTp4MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "qwenimage_b1_square");
}

// Qwen-Image-Edit-2511's zero_cond_t: the reference grids' tokens take timestep 0's modulation,
// which the sharded (gathered) modulation must keep per token.
TEST(TpQwenImage, GoldenZeroCondTTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "qwenimage_edit_zero_cond_t_b2");
}

TEST(TpQwenImage, GoldenZeroCondTTp4MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "qwenimage_edit_zero_cond_t_b2");
}

// ---------------------------------------------------------------------------------------------
// The reference plans (diffusers' `_tp_plan`: modulation whole on every rank) give the same
// outputs as TP=1 too.

TEST(TpReferencePlan, GoldenFluxTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "flux_b2_nonsquare", TpPlanKind::Reference);
}

TEST(TpReferencePlan, GoldenFlux2Tp4MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "flux2_b1_square", TpPlanKind::Reference);
}

TEST(TpReferencePlan, GoldenKleinTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "flux2_klein_b2_nonsquare", TpPlanKind::Reference);
}

TEST(TpReferencePlan, GoldenQwenImageTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "qwenimage_b2_nonsquare", TpPlanKind::Reference);
}

TEST(TpReferencePlan, BuiltinTp3MatchesTp1) {
  if (is_worker()) return tp_worker();
  const auto paths = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  expect_tp_matches(3, paths.pipeline, paths.inputs, TpPlanKind::Reference);
}

TEST(TpReferencePlan, GoldenModulationIsReplicatedAndTheRestAsTheFullPlan) {
  // The reference plan is the full plan less the modulation linears, for every family.
  for (const char* golden_case : {"flux_b1_square", "flux2_b1_square", "qwenimage_b1_square"}) {
    SCOPED_TRACE(golden_case);
    auto model = create(golden_path(golden_case));
    const auto full = model->resolve(2, at::kFloat, TpPlanKind::Full);
    const auto reference = model->resolve(2, at::kFloat, TpPlanKind::Reference);
    ASSERT_EQ(full.parameters.size(), reference.parameters.size());
    int differing = 0;
    for (size_t i = 0; i < full.parameters.size(); ++i) {
      const auto& ours = full.parameters[i];
      const auto& theirs = reference.parameters[i];
      if (ours.style == theirs.style) continue;
      ++differing;
      EXPECT_EQ(ours.style, ShardStyle::ColwiseGather) << ours.parameter;
      EXPECT_FALSE(theirs.is_sharded()) << theirs.parameter;
    }
    EXPECT_GT(differing, 0);
    EXPECT_LT(full.bytes_on_rank(0), reference.bytes_on_rank(0));
  }
}

TEST(TpFlux2, GoldenFusedProjectionsAreSplitBlockByBlock) {
  // At TP=2 each rank holds half of every declared block of the fused layers.
  const std::string dir = golden_path("flux2_b1_square");
  const auto plan = create(dir)->resolve(2);
  // to_qkv_mlp_proj: [q | k | v | gate | up] = 3 * inner + 2 * (inner * mlp_ratio) rows of inner.
  const nlohmann::json& config = shardit::io::open_component(dir, "transformer").config;
  const int64_t inner = config.at("num_attention_heads").get<int64_t>() * config.at("attention_head_dim").get<int64_t>();
  const auto mlp_hidden = static_cast<int64_t>(static_cast<double>(inner) * config.at("mlp_ratio").get<double>());
  const auto& qkv_mlp = plan.spec("single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight");
  ASSERT_TRUE(qkv_mlp.style.has_value());
  EXPECT_EQ(*qkv_mlp.style, ShardStyle::PackedColwise);
  ASSERT_EQ(qkv_mlp.ranges_per_rank.size(), 2u);
  EXPECT_EQ(qkv_mlp.ranges_per_rank[1].size(), 5u);  // one range per block: q, k, v, gate, up
  EXPECT_EQ(qkv_mlp.local_shape(1), (std::vector<int64_t>{(3 * inner + 2 * mlp_hidden) / 2, inner}));
  const auto& to_out = plan.spec("single_transformer_blocks.0.attn.to_out.weight");
  EXPECT_EQ(to_out.dim, 1);
  EXPECT_EQ(to_out.ranges_per_rank[0].size(), 2u);  // attn, mlp
  const auto& linear_in = plan.spec("transformer_blocks.0.ff.linear_in.weight");
  EXPECT_EQ(linear_in.ranges_per_rank[1].size(), 2u);  // gate, up
  const auto& modulation = plan.spec("double_stream_modulation_img.linear.weight");
  ASSERT_TRUE(modulation.style.has_value());
  EXPECT_EQ(*modulation.style, ShardStyle::ColwiseGather);
}

// ---------------------------------------------------------------------------------------------
// Errors and the CLI, for every golden model family

class TpGoldenModel : public ::testing::TestWithParam<std::string> {};

TEST_P(TpGoldenModel, DegreeThatDoesNotDivideHeadsIsRejectedBeforeLoading) {
  // The smallest degree that cannot split the heads: the error names the constraint and the
  // degrees that work.
  const std::string dir = golden_path(GetParam());
  const int64_t heads =
      shardit::io::open_component(dir, "transformer").config.at("num_attention_heads").get<int64_t>();
  int degree = 2;
  while (heads % degree == 0) ++degree;
  auto model = create(dir);
  EXPECT_EQ(shardit::testing::error_of([&] { model->resolve(degree); }),
            "num_attention_heads = " + std::to_string(heads) +
                ", which does not divide by tp_degree " + std::to_string(degree) +
                "; degrees that would work (up to 64): " + shardit::testing::divisors_of(heads));
  EXPECT_FALSE(model->is_materialized());
}

TEST_P(TpGoldenModel, CliRunTransformerAtTp2MatchesGolden) {
  // Every rank loads its shard (TP degree = world size) and runs; rank 0 writes.
  const std::string out = shardit::testing::make_temp_dir("cli-tp2") + "/sample.safetensors";
  const std::string case_dir = golden_path(GetParam());
  std::string output;
  const int status = shardit::testing::run_command(shardit::testing::cli_path() +
                                                       " --nproc-per-node 2 run-transformer --model " + case_dir +
                                                       " --inputs " + case_dir + " --out " + out,
                                                   &output);
  ASSERT_EQ(status, 0) << output;
  EXPECT_THAT(output, HasSubstr("tp 2"));
  const at::Tensor got = shardit::io::SafetensorsFile::open(out)->read("sample");
  const at::Tensor golden = shardit::io::SafetensorsFile::open(case_dir + "/outputs.safetensors")->read("sample");
  // The golden tolerance of the README: 1e-4 + 1e-4 |expected| in fp32.
  EXPECT_TRUE(tensors_close("CLI sample at TP=2", got, golden, 1e-4, 1e-4));
}

INSTANTIATE_TEST_SUITE_P(Families, TpGoldenModel, ::testing::Values("flux_b2_nonsquare", "flux2_b2_nonsquare",
                                                                    "qwenimage_b2_nonsquare"));

TEST(TpFlux, CliRunsTheBuiltinModelWithoutArguments) {
  // The quick start's forward: no --model means the built-in tiny model and its input case.
  const std::string dir = shardit::testing::make_temp_dir("cli-builtin");
  const std::string cli = shardit::testing::cli_path();
  std::string output;
  ASSERT_EQ(shardit::testing::run_command(cli + " run-transformer --out " + dir + "/tp1.safetensors", &output), 0)
      << output;
  EXPECT_THAT(output, HasSubstr("built-in tiny model"));
  ASSERT_EQ(shardit::testing::run_command(cli + " --nproc-per-node 2 run-transformer --out " + dir + "/tp2.safetensors",
                                          &output),
            0)
      << output;
  const at::Tensor tp1 = shardit::io::SafetensorsFile::open(dir + "/tp1.safetensors")->read("sample");
  const at::Tensor tp2 = shardit::io::SafetensorsFile::open(dir + "/tp2.safetensors")->read("sample");
  EXPECT_TRUE(tensors_close("built-in sample, TP=2 vs TP=1", tp2, tp1, kTpScaleTolerance * tp1.abs().max().item<double>(),
                            0.0));
}

}  // namespace
}  // namespace test_tp_transformers
