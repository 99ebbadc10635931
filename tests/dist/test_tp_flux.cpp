// FLUX.1 under real tensor parallelism: ranks at TP=N (separate processes on this host) must give
// the single-rank output, through both load paths (shard while loading; load whole, then
// enable_parallelism). The golden models have 4 heads (TP=2, 4); the built-in tiny model has 12
// (TP=3, a degree that is not a power of two).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/registry.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace {

using shardit::models::FluxTransformer2DModel;
using shardit::models::FluxTransformer2DModelInputs;
using shardit::parallel::LoadOptions;
using shardit::parallel::TensorParallelConfig;
using shardit::testing::env_or;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;
using ::testing::HasSubstr;

struct LoadedFlux {
  std::shared_ptr<shardit::parallel::TensorParallelModule> module;
  FluxTransformer2DModel* model;
};

/// Loads the FLUX.1 transformer of `model_dir`; `path` is "whole", "shard-on-load" or
/// "enable-parallelism" (load whole, then shard in memory).
LoadedFlux load_flux(const std::string& model_dir, const std::string& path) {
  const auto folder = shardit::io::open_component(model_dir, "transformer");
  LoadedFlux loaded;
  loaded.module = shardit::models::create_transformer(folder);
  loaded.model = dynamic_cast<FluxTransformer2DModel*>(loaded.module.get());
  EXPECT_NE(loaded.model, nullptr);
  const int world_size = shardit::dist::World::get().size();
  LoadOptions options;
  if (path == "shard-on-load") options.tensor_parallel = TensorParallelConfig::from_degree(world_size);
  loaded.module->load(folder.weights(), options);
  if (path == "enable-parallelism") loaded.module->enable_parallelism(TensorParallelConfig::from_degree(world_size));
  return loaded;
}

at::Tensor run_case(FluxTransformer2DModel& model, const std::string& inputs_dir) {
  const auto file = shardit::io::SafetensorsFile::open(inputs_dir + "/inputs.safetensors");
  return model.forward(FluxTransformer2DModelInputs::read(*file));
}

// The TP=N sample may differ from TP=1 only by the order of fp32 sums (each rowwise layer adds N
// partial products instead of one dot product), an error that scales with the activations, not
// with each output element: ~1e-7 to 1e-6 of the output's scale. 1e-5 of max|reference| leaves
// room for that and fails on any sharding error, which moves values by O(scale).
constexpr double kTpScaleTolerance = 1e-5;

/// Worker body: load through `SHARDIT_TP_PATH`, run, compare with the reference written by the
/// parent (TP=1 in this same build), and check that shard-on-load read only this rank's bytes.
void tp_worker() {
  auto& world = shardit::dist::World::init();
  const std::string model_dir = env_or("SHARDIT_TP_MODEL");
  const std::string path = env_or("SHARDIT_TP_PATH");
  LoadedFlux loaded = load_flux(model_dir, path);
  const at::Tensor sample = run_case(*loaded.model, env_or("SHARDIT_TP_INPUTS"));
  const auto reference = shardit::io::SafetensorsFile::open(env_or("SHARDIT_TP_REFERENCE"));
  const at::Tensor expected = reference->read("sample");
  const double scale = expected.abs().max().item<double>();
  EXPECT_TRUE(tensors_close("sample at TP=" + std::to_string(world.size()) + " (" + path + ")", sample, expected,
                            kTpScaleTolerance * scale, 0.0));
  // Every rank holds exactly the replicated parameters plus its share of the sharded ones (the
  // plan is resolved on a fresh, unloaded model: a sharded one no longer knows its full shapes).
  const auto plan = shardit::models::create_transformer(shardit::io::open_component(model_dir, "transformer"))
                        ->resolve(world.size());
  EXPECT_EQ(loaded.module->parameter_bytes(), plan.bytes_on_rank(world.rank()));
  EXPECT_LT(plan.bytes_on_rank(world.rank()), plan.replicated_bytes() + plan.sharded_bytes());
}

/// Parent: computes the TP=1 reference in this process and writes it for the workers.
std::string write_reference(const std::string& model_dir, const std::string& inputs_dir) {
  LoadedFlux loaded = load_flux(model_dir, "whole");
  const at::Tensor sample = run_case(*loaded.model, inputs_dir);
  const std::string path = shardit::testing::make_temp_dir("tp-flux") + "/reference.safetensors";
  shardit::io::save_safetensors(path, {{"sample", sample}});
  return path;
}

/// Runs this test (`test_name`) as `nproc` ranks for each load path; each rank runs tp_worker().
void expect_tp_matches(int nproc, const std::string& test_name, const std::string& model_dir,
                       const std::string& inputs_dir) {
  const std::string reference = write_reference(model_dir, inputs_dir);
  for (const std::string path : {"shard-on-load", "enable-parallelism"}) {
    EXPECT_EQ(run_ranks(nproc, test_name,
                        {{"SHARDIT_TP_MODEL", model_dir},
                         {"SHARDIT_TP_INPUTS", inputs_dir},
                         {"SHARDIT_TP_PATH", path},
                         {"SHARDIT_TP_REFERENCE", reference}}),
              0)
        << "TP=" << nproc << " through " << path;
  }
}

TEST(TpFlux, GoldenTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_tp_matches(2, "TpFlux.GoldenTp2MatchesTp1", golden_path("flux_b2_nonsquare"), golden_path("flux_b2_nonsquare"));
}

TEST(TpFlux, GoldenTp4MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_tp_matches(4, "TpFlux.GoldenTp4MatchesTp1", golden_path("flux_b1_square"), golden_path("flux_b1_square"));
}

TEST(TpFlux, SchnellTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_tp_matches(2, "TpFlux.SchnellTp2MatchesTp1", golden_path("flux_schnell_b2_nonsquare"), golden_path("flux_schnell_b2_nonsquare"));
}

TEST(TpFlux, BuiltinTp3MatchesTp1) {
  if (is_worker()) return tp_worker();
  const auto paths = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  expect_tp_matches(3, "TpFlux.BuiltinTp3MatchesTp1", paths.pipeline, paths.inputs);
}

TEST(TpFlux, DegreeThatDoesNotDivideHeadsIsRejectedBeforeLoading) {
  // 4 heads: TP=3 cannot split them; the error names the constraint and the degrees that work.
  const auto folder = shardit::io::open_component(golden_path("flux_b1_square"), "transformer");
  auto model = shardit::models::create_transformer(folder);
  try {
    model->resolve(3);
    FAIL() << "TP=3 on a 4-head model was accepted";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_THAT(message, HasSubstr("3"));
    EXPECT_THAT(message, HasSubstr("1, 2, 4"));
  }
  EXPECT_FALSE(model->is_materialized());
}

TEST(TpFlux, CliRunTransformerAtTp2MatchesGolden) {
  // Every rank loads its shard (TP degree = world size) and runs; rank 0 writes.
  const std::string out = shardit::testing::make_temp_dir("cli-tp2") + "/sample.safetensors";
  const std::string case_dir = golden_path("flux_b2_nonsquare");
  std::string output;
  const int status = shardit::testing::run_command(shardit::testing::cli_path() + " --nproc-per-node 2 run-transformer --model " +
                                                       case_dir + " --inputs " + case_dir + " --out " + out,
                                                   &output);
  ASSERT_EQ(status, 0) << output;
  EXPECT_THAT(output, HasSubstr("tp 2"));
  const auto written = shardit::io::SafetensorsFile::open(out);
  const auto golden = shardit::io::SafetensorsFile::open(case_dir + "/outputs.safetensors");
  // The golden tolerance of the README: 1e-4 + 1e-4 |expected| in fp32.
  EXPECT_TRUE(tensors_close("CLI sample at TP=2", written->read("sample"), golden->read("sample"), 1e-4, 1e-4));
}

TEST(TpFlux, CliRunsTheBuiltinModelWithoutArguments) {
  // The quick start's forward: no --model means the built-in tiny model and its input case.
  const std::string dir = shardit::testing::make_temp_dir("cli-builtin");
  std::string output;
  ASSERT_EQ(shardit::testing::run_command(shardit::testing::cli_path() + " run-transformer --out " + dir + "/tp1.safetensors",
                                          &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("built-in tiny model"));
  ASSERT_EQ(shardit::testing::run_command(shardit::testing::cli_path() + " --nproc-per-node 2 run-transformer --out " + dir +
                                              "/tp2.safetensors",
                                          &output),
            0)
      << output;
  const at::Tensor tp1 = shardit::io::SafetensorsFile::open(dir + "/tp1.safetensors")->read("sample");
  const at::Tensor tp2 = shardit::io::SafetensorsFile::open(dir + "/tp2.safetensors")->read("sample");
  EXPECT_TRUE(tensors_close("built-in sample, TP=2 vs TP=1", tp2, tp1, kTpScaleTolerance * tp1.abs().max().item<double>(), 0.0));
}

}  // namespace
