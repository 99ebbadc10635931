// The pipeline golden cases under every cfg x ulysses x ring x tp mesh of 4 ranks: each mesh the
// case can run on (CFG-parallel only where the request runs CFG; the golden transformers have 4
// heads, so every tp x ulysses of 4 ranks splits them) must give diffusers' latents after every
// step on every rank, and its image on rank 0, within the case's tolerances. One 4-rank launch per
// case walks the meshes in turn, each built over the same world. The text and image sequences of
// the cases do not divide by every degree, so padding under Ulysses and ring runs too.
// `shardit generate --ulysses/--ring` is run once on 4 ranks to show the flags reach the pipeline.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/io/safetensors.h"
#include "shardit/parallel/context_parallel.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/pipelines/pipeline.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_pipeline_mesh {
namespace {

using shardit::parallel::ParallelDims;
using shardit::pipelines::DiffusionPipeline;
using shardit::pipelines::PipelineLoadOptions;
using shardit::testing::env_or;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;

constexpr int kRanks = 4;

/// Runs the case on one mesh and compares every step (all ranks) and the image (rank 0).
void expect_mesh_matches(shardit::testing::PipelineCase& golden, const ParallelDims& dims) {
  auto& world = shardit::dist::World::get();
  PipelineLoadOptions options;
  options.parallel = dims.build(world);
  options.load_text_encoders = false;
  const auto pipeline = DiffusionPipeline::from_pretrained(golden.dir, options);
  ASSERT_EQ(pipeline->parallel_dims(), dims);
  // The transformer's sequence is split whenever the mesh has a ulysses or ring dimension.
  const auto* cp = pipeline->transformer()->context_parallel_config();
  ASSERT_EQ(cp != nullptr, dims.ulysses * dims.ring > 1);
  if (cp != nullptr) {
    EXPECT_EQ(cp->cp_degree(), dims.ulysses * dims.ring);
  }
  std::vector<at::Tensor> steps;
  golden.request.callback_on_step_end = [&steps](int64_t, const at::Tensor& latents) {
    steps.push_back(latents.clone());
  };
  const auto result = pipeline->generate(golden.request);
  const std::string what = golden.dir + " (" + dims.to_string() + ")";
  ASSERT_EQ(static_cast<int64_t>(steps.size()), golden.steps) << what;
  if (world.rank() == 0) {
    shardit::testing::expect_pipeline_matches(golden, steps, result.image, what);
    return;
  }
  const auto outputs = shardit::io::SafetensorsFile::open(golden.dir + "/outputs.safetensors");
  for (int64_t k = 0; k < golden.steps; ++k) {
    const std::string name = "step" + std::to_string(k) + ".latents";
    EXPECT_TRUE(shardit::testing::tensors_close(what + ": " + name, steps[static_cast<size_t>(k)], outputs->read(name),
                                                shardit::testing::kPipelineAtol, shardit::testing::kPipelineRtol));
  }
}

void every_mesh_worker() {
  auto& world = shardit::dist::World::init();
  ASSERT_EQ(world.size(), kRanks);
  auto golden = shardit::testing::read_pipeline_case(env_or("SHARDIT_PIPELINE_CASE"));
  bool runs_cfg = false;
  {
    PipelineLoadOptions options;
    options.load_text_encoders = false;
    runs_cfg = DiffusionPipeline::open(golden.dir, options)->runs_cfg(golden.request);
  }
  int meshes = 0;
  for (const ParallelDims& dims : ParallelDims::fitting(kRanks)) {
    if (dims.cfg > 1 && !runs_cfg) continue;
    if (dims.ulysses == 1 && dims.ring == 1 && dims.cfg == 1) continue;  // tp alone: test_pipelines
    SCOPED_TRACE(dims.to_string());
    expect_mesh_matches(golden, dims);
    ++meshes;
  }
  // (ulysses, ring, tp) = (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1); with CFG, cfg 2
  // with (1, 1, 2), (1, 2, 1) and (2, 1, 1) too.
  EXPECT_EQ(meshes, runs_cfg ? 8 : 5);
}

class PipelineMesh : public ::testing::TestWithParam<std::string> {};

TEST_P(PipelineMesh, EveryContextParallelMeshOfFourRanksMatchesDiffusers) {
  if (is_worker()) return every_mesh_worker();
  EXPECT_EQ(run_ranks(kRanks, {{"SHARDIT_PIPELINE_CASE", shardit::testing::golden_path(GetParam())}}), 0);
}

INSTANTIATE_TEST_SUITE_P(Golden, PipelineMesh,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_flux2_dev", "pipeline_qwenimage"),
                         [](const auto& info) { return info.param; });

TEST(PipelineMeshCli, GoldenQwenImageCfgUlyssesRingOnFourRanks) {
  if (is_worker()) return;
  auto golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path("pipeline_qwenimage"));
  const std::vector<std::pair<std::vector<std::string>, std::string>> runs = {
      {{"--cfg-parallel", "--ulysses", "2"}, "mesh cfg=2 x ulysses=2 x ring=1 x tp=1"},
      {{"--ulysses", "2", "--ring", "2"}, "mesh cfg=1 x ulysses=2 x ring=2 x tp=1"}};
  for (const auto& [flag_list, mesh] : runs) {
    auto args = golden;
    std::string flags;
    for (const std::string& flag : flag_list) {
      args.cli_args.push_back(flag);
      flags += " " + flag;
    }
    const auto run = shardit::testing::run_generate_cli(args, "--nproc-per-node 4");
    EXPECT_NE(run.output.find(mesh), std::string::npos) << run.output;
    shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, "CLI " + flags);
    shardit::testing::expect_pngs_match(golden, run.pngs, "CLI PNG " + flags);
  }
}

}  // namespace
}  // namespace test_pipeline_mesh
