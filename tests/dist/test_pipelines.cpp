// The pipelines with the transformer under real tensor parallelism: ranks at TP=2 and 4 (separate
// processes) reproduce diffusers' golden pipeline runs (latents after every step, image, PNG)
// through the C++ API (sharded while loading, and loaded whole then enable_parallelism) and
// through `shardit generate --nproc-per-node`. The golden transformers have 4 heads (TP 2 or 4);
// the built-in tiny pipeline has 12, so TP=3 is checked against TP=1 there.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "shardit/dist/world.h"
#include "shardit/io/png.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/pipelines/pipeline.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace {

using shardit::parallel::TensorParallelConfig;
using shardit::testing::env_or;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;

void api_worker() {
  auto& world = shardit::dist::World::init();
  shardit::testing::PipelineCase golden = shardit::testing::read_pipeline_case(env_or("SHARDIT_PIPELINE_CASE"));
  const std::string path = env_or("SHARDIT_PIPELINE_PATH");
  shardit::pipelines::PipelineLoadOptions options;
  if (path == "shard-on-load") options.transformer_parallel = TensorParallelConfig::from_degree(world, world.size());
  const auto pipeline = shardit::pipelines::DiffusionPipeline::from_pretrained(golden.dir, options);
  if (path == "enable-parallelism") {
    pipeline->transformer()->enable_parallelism(TensorParallelConfig::from_degree(world, world.size()));
  }
  ASSERT_EQ(pipeline->transformer()->tp_degree(), world.size());
  EXPECT_EQ(pipeline->vae() != nullptr, world.rank() == 0) << "only rank 0 loads the VAE and decodes";
  std::vector<at::Tensor> steps;
  golden.request.callback_on_step_end = [&steps](int64_t, const at::Tensor& latents) {
    steps.push_back(latents.clone());
  };
  const auto result = pipeline->generate(golden.request);
  const std::string what = golden.dir + " (API, TP=" + std::to_string(world.size()) + ", " + path + ")";
  if (world.rank() == 0) {
    shardit::testing::expect_pipeline_matches(golden, steps, result.image, what);
  } else {
    EXPECT_FALSE(result.image.defined());
    const auto outputs = shardit::io::SafetensorsFile::open(golden.dir + "/outputs.safetensors");
    const std::string last = "step" + std::to_string(golden.steps - 1) + ".latents";
    EXPECT_TRUE(shardit::testing::tensors_close(what + ": " + last, result.latents, outputs->read(last),
                                                shardit::testing::kPipelineAtol, shardit::testing::kPipelineRtol));
  }
}

class PipelinesTp : public ::testing::TestWithParam<std::string> {};

TEST_P(PipelinesTp, GoldenApiTp2) {
  if (is_worker()) return api_worker();
  const std::string dir = shardit::testing::golden_path(GetParam());
  for (const std::string path : {"shard-on-load", "enable-parallelism"}) {
    EXPECT_EQ(run_ranks(2, {{"SHARDIT_PIPELINE_CASE", dir}, {"SHARDIT_PIPELINE_PATH", path}}), 0) << path;
  }
}

// Each golden transformer has 4 heads: TP=4 is the other degree they allow.
TEST_P(PipelinesTp, GoldenApiTp4) {
  if (is_worker()) return api_worker();
  const std::string dir = shardit::testing::golden_path(GetParam());
  EXPECT_EQ(run_ranks(4, {{"SHARDIT_PIPELINE_CASE", dir}, {"SHARDIT_PIPELINE_PATH", "shard-on-load"}}), 0);
}

TEST_P(PipelinesTp, GoldenCliTp2) {
  if (is_worker()) return;
  const auto golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path(GetParam()));
  const auto run = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2");
  EXPECT_NE(run.output.find("tp 2 of 2 ranks"), std::string::npos) << run.output;
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, GetParam() + " (CLI, TP=2)");
  shardit::testing::expect_pngs_match(golden, run.pngs, GetParam() + " (CLI PNG, TP=2)");
}

INSTANTIATE_TEST_SUITE_P(Golden, PipelinesTp,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_qwenimage"),
                         [](const auto& info) { return info.param.substr(9); });

// The built-in pipeline (12 heads) at TP=3 and on 2 ranks with --tp 1 (replicas) against one
// rank: the same image up to the order of fp32 sums, the same PNG up to one level.
TEST(PipelinesBuiltin, Tp3AndReplicasMatchTp1) {
  if (is_worker()) return;
  const std::string dir = shardit::testing::make_temp_dir("pipeline-builtin");
  const auto builtin = shardit::models::write_builtin_model(dir + "/model");
  const auto generate = [&](const std::string& name, const std::string& options) {
    const std::string command = shardit::testing::cli_path() + " generate " + options + " --model " + builtin.pipeline +
                                " --prompt-embeds " + builtin.prompt_embeds +
                                " --height 64 --width 96 --steps 3 --seed 7 --out " + dir + "/" + name +
                                ".png --out-tensors " + dir + "/" + name + ".safetensors";
    std::string output;
    EXPECT_EQ(shardit::testing::run_command(command, &output), 0) << output;
    return std::make_pair(shardit::io::SafetensorsFile::open(dir + "/" + name + ".safetensors")->read("image"),
                          shardit::io::read_png(dir + "/" + name + ".png").to(at::kInt));
  };
  const auto [tp1, tp1_png] = generate("tp1", "");
  EXPECT_EQ(tp1.sizes(), (std::vector<int64_t>{1, 64, 96, 3}));
  // TP=3 differs only by the order of fp32 sums in the rowwise layers; replicas run TP=1 each with
  // fewer intra-op threads.
  for (const auto& [name, options] :
       {std::pair<std::string, std::string>{"tp3", "--nproc-per-node 3"}, {"replicas", "--nproc-per-node 2 --tp 1"}}) {
    const auto [image, png] = generate(name, options);
    EXPECT_TRUE(shardit::testing::tensors_close(name + " image", image, tp1, 1e-4, 0));
    EXPECT_LE((png - tp1_png).abs().max().item<int>(), 1) << name;
  }
}

}  // namespace
