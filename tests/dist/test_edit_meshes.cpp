// Editing with reference images on every mesh: the golden edit cases (FLUX.2 [klein] with one and
// two references, FLUX.2 [dev], FLUX.1 Kontext) must give diffusers' latents after every step and
// its image whatever the layout of the ranks. The reference tokens join the image stream, so
// under Ulysses and ring the joint sequence (text + noise + references) is split and gathered;
// the VAE that encodes the references lives on rank 0 (the others receive the latents), or on every
// rank with --vae-parallel; a step cache decides the same on every mesh. `shardit generate --image`
// runs on 2 and 4 ranks too. Qwen-Image editing (QwenImageEditPlusPipeline, QwenImageEditPipeline,
// and Qwen-Image-Edit-2511's zero_cond_t transformer) with its text encoder and vision tower
// sharded too, on 2 and 4 ranks, and with --vae-parallel.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "shardit/dist/world.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/step_cache.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/pipelines/pipeline.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_edit_meshes {
namespace {

using shardit::models::StepCacheConfig;
using shardit::parallel::ParallelDims;
using shardit::pipelines::DiffusionPipeline;
using shardit::pipelines::GenerateResult;
using shardit::pipelines::PipelineLoadOptions;
using shardit::testing::env_or;
using shardit::testing::is_worker;
using shardit::testing::PipelineCase;
using shardit::testing::run_ranks;

constexpr int kRanks = 2;

struct MeshRun {
  GenerateResult result;
  std::vector<at::Tensor> steps;
};

MeshRun generate_on(const PipelineCase& golden, const ParallelDims& dims, bool vae_parallel,
                    const std::optional<StepCacheConfig>& cache) {
  auto& world = shardit::dist::World::get();
  PipelineLoadOptions options;
  options.parallel = dims.build(world);
  options.load_text_encoders = false;
  options.pipeline_class = golden.pipeline_class;
  options.vae_parallel = vae_parallel;
  const auto pipeline = DiffusionPipeline::from_pretrained(golden.dir, options);
  MeshRun run;
  auto request = golden.request;
  request.cache = cache;
  request.callback_on_step_end = [&run](int64_t, const at::Tensor& latents) { run.steps.push_back(latents.clone()); };
  run.result = pipeline->generate(request);
  return run;
}

/// Every step on every rank, and the image where this rank has one, against diffusers'.
void expect_run_matches(const PipelineCase& golden, const MeshRun& run, const std::string& what) {
  ASSERT_EQ(static_cast<int64_t>(run.steps.size()), golden.steps) << what;
  if (run.result.image.defined()) {
    shardit::testing::expect_pipeline_matches(golden, run.steps, run.result.image, what);
    return;
  }
  const auto outputs = shardit::io::SafetensorsFile::open(golden.outputs_dir + "/outputs.safetensors");
  for (int64_t k = 0; k < golden.steps; ++k) {
    const std::string name = golden.output_prefix + "step" + std::to_string(k) + ".latents";
    EXPECT_TRUE(shardit::testing::tensors_close(what + ": " + name, run.steps[static_cast<size_t>(k)],
                                                outputs->read(name), shardit::testing::kPipelineAtol,
                                                shardit::testing::kPipelineRtol));
  }
}

void edit_mesh_worker() {
  auto& world = shardit::dist::World::init();
  ASSERT_EQ(world.size(), kRanks);
  const PipelineCase golden = shardit::testing::read_edit_case(env_or("SHARDIT_EDIT_CASE"), env_or("SHARDIT_EDIT_RUN"));
  const std::string label = env_or("SHARDIT_EDIT_CASE") + " " + env_or("SHARDIT_EDIT_RUN");
  bool runs_cfg = false;
  {
    PipelineLoadOptions options;
    options.load_text_encoders = false;
    options.pipeline_class = golden.pipeline_class;
    runs_cfg = DiffusionPipeline::open(golden.dir, options)->runs_cfg(golden.request);
  }
  int meshes = 0;
  for (const ParallelDims& dims : ParallelDims::fitting(kRanks)) {
    if (dims.cfg > 1 && !runs_cfg) continue;
    SCOPED_TRACE(dims.to_string());
    expect_run_matches(golden, generate_on(golden, dims, false, std::nullopt), label + " on " + dims.to_string());
    ++meshes;
  }
  // tp 2, ulysses 2, ring 2; and cfg 2 where the request runs CFG.
  EXPECT_EQ(meshes, runs_cfg ? 4 : 3);

  // Every rank encodes a band of each reference image's rows, and decodes a band of the output's.
  expect_run_matches(golden, generate_on(golden, ParallelDims{1, 1, 1, kRanks}, true, std::nullopt),
                     label + " with --vae-parallel");

  // A First-Block Cache that skips every step it may: the same decisions and latents on a split
  // sequence as on one rank.
  const StepCacheConfig cache = StepCacheConfig::parse("first_block_cache:threshold=1000000");
  const MeshRun alone = generate_on(golden, ParallelDims{1, 1, 1, 1}, false, cache);
  ASSERT_TRUE(alone.result.cache_computed.defined());
  EXPECT_LT(alone.result.cache_computed.sum().item<int64_t>(), alone.result.cache_computed.numel());
  for (const ParallelDims& dims : {ParallelDims{1, kRanks, 1, 1}, ParallelDims{1, 1, kRanks, 1}}) {
    const MeshRun split = generate_on(golden, dims, false, cache);
    const std::string what = label + " cached on " + dims.to_string();
    EXPECT_TRUE(at::equal(split.result.cache_computed, alone.result.cache_computed)) << what;
    EXPECT_TRUE(shardit::testing::tensors_close(what + ": latents", split.result.latents, alone.result.latents,
                                                shardit::testing::kPipelineAtol, shardit::testing::kPipelineRtol));
  }
}

struct EditRun {
  std::string name;
  std::string run;
};

class EditMesh : public ::testing::TestWithParam<EditRun> {};

TEST_P(EditMesh, EveryMeshOfTwoRanksMatchesDiffusers) {
  if (is_worker()) return edit_mesh_worker();
  EXPECT_EQ(run_ranks(kRanks, {{"SHARDIT_EDIT_CASE", GetParam().name}, {"SHARDIT_EDIT_RUN", GetParam().run}}), 0);
}

INSTANTIATE_TEST_SUITE_P(Golden, EditMesh,
                         ::testing::Values(EditRun{"edit_flux2_klein", "refs_ab"}, EditRun{"edit_flux2_dev", "refs_a"},
                                           EditRun{"edit_flux1_kontext", "refs_a"}),
                         [](const auto& info) { return info.param.name + "_" + info.param.run; });

// Qwen-Image editing on meshes: each mesh loads the pipeline once (text encoder with its vision
// tower at its own degree, transformer on the mesh) and runs several golden runs in it; every
// step and the image must be diffusers'.
struct QwenEditMesh {
  ParallelDims dims;
  std::optional<int> text_encoder_tp;  ///< none: the largest degree its heads allow
  std::vector<std::string> runs;
  std::optional<std::string> pipeline_class;
  /// The golden folder: edit_qwenimage, or edit_qwenimage_zero_cond_t (Qwen-Image-Edit-2511's
  /// transformer).
  std::string folder = "edit_qwenimage";
  /// --vae-parallel: every rank holds the VAE, encodes a band of each image's rows and decodes a
  /// band of the output's, and so holds the image.
  bool vae_parallel = false;
};

void qwen_edit_mesh_worker(const std::vector<QwenEditMesh>& meshes) {
  auto& world = shardit::dist::World::init();
  for (const QwenEditMesh& mesh : meshes) {
    const std::string label = mesh.dims.to_string() + " text encoder tp " +
                              (mesh.text_encoder_tp ? std::to_string(*mesh.text_encoder_tp) : std::string("auto")) +
                              (mesh.vae_parallel ? " --vae-parallel" : "");
    SCOPED_TRACE(label);
    PipelineLoadOptions options;
    options.parallel = mesh.dims.build(world);
    options.text_encoder_tp = mesh.text_encoder_tp;
    options.pipeline_class = mesh.pipeline_class;
    options.vae_parallel = mesh.vae_parallel;
    const auto pipeline = DiffusionPipeline::from_pretrained(shardit::testing::golden_path(mesh.folder), options);
    if (mesh.vae_parallel) {
      ASSERT_NE(pipeline->vae(), nullptr) << label;
      EXPECT_EQ(pipeline->vae()->parallel_decode_degree(), world.size()) << label;
    }
    for (const std::string& tag : mesh.runs) {
      const PipelineCase golden = shardit::testing::read_qwen_edit_case(tag, mesh.folder);
      ASSERT_EQ(golden.pipeline_class, mesh.pipeline_class) << tag;
      MeshRun run;
      auto request = golden.request;
      request.callback_on_step_end = [&run](int64_t, const at::Tensor& latents) {
        run.steps.push_back(latents.clone());
      };
      run.result = pipeline->generate(request);
      if (mesh.vae_parallel) {
        EXPECT_TRUE(run.result.image.defined()) << tag << " on " << label << ": no image";
      }
      expect_run_matches(golden, run, mesh.folder + " " + tag + " on " + label);
    }
  }
}

// Transformer TP 1 and 2 with the text encoder (and its vision tower) at TP 1 and 2; one TP 2
// mesh with --vae-parallel (the three images encoded and the output decoded in bands on both
// ranks); Qwen-Image-Edit-2511's transformer (zero_cond_t) at TP 2.
TEST(QwenEditMeshGolden, TwoRanksTransformerAndTextEncoderTp) {
  const std::vector<QwenEditMesh> meshes = {
      {ParallelDims{1, 1, 1, 1}, 2, {"plus_three_cfg", "plus_one"}, std::nullopt},
      {ParallelDims{1, 1, 1, 2}, 1, {"plus_three_cfg", "plus_two"}, std::nullopt},
      {ParallelDims{1, 1, 1, 2}, 1, {"plus_three_cfg", "plus_two"}, std::nullopt, "edit_qwenimage", true},
      {ParallelDims{1, 1, 1, 2}, 2, {"plus_two_cfg", "plus_three", "plus_one_cfg"}, std::nullopt},
      {ParallelDims{1, 1, 1, 2}, 2, {"edit_one_cfg", "edit_one"}, std::string("QwenImageEditPipeline")},
      {ParallelDims{1, 1, 1, 2}, 2, {"plus_two_cfg_zero_cond_t"}, std::nullopt, "edit_qwenimage_zero_cond_t"},
  };
  if (is_worker()) return qwen_edit_mesh_worker(meshes);
  EXPECT_EQ(run_ranks(2), 0);
}

// TP 4 (every golden run), Ulysses 2 x TP 2, ring 2 x TP 2 and CFG-parallel x TP 2: the reference
// tokens split with the noise tokens; under CFG-parallel the two halves run the prompt and the
// negative prompt. Qwen-Image-Edit-2511's transformer at TP 4 and under Ulysses 2 x TP 2: the
// reference-token mask of zero_cond_t split with the sequence.
TEST(QwenEditMeshGolden, FourRanksTpUlyssesRingCfgParallel) {
  const std::vector<QwenEditMesh> meshes = {
      {ParallelDims{1, 1, 1, 4},
       std::nullopt,
       {"plus_three_cfg", "plus_one", "plus_one_cfg", "plus_two", "plus_two_cfg", "plus_three"},
       std::nullopt},
      {ParallelDims{1, 1, 1, 4}, std::nullopt, {"edit_one_cfg", "edit_one"}, std::string("QwenImageEditPipeline")},
      {ParallelDims{1, 1, 1, 4}, std::nullopt, {"plus_two_cfg_zero_cond_t"}, std::nullopt, "edit_qwenimage_zero_cond_t"},
      {ParallelDims{1, 2, 1, 2}, std::nullopt, {"plus_three_cfg", "plus_two"}, std::nullopt},
      {ParallelDims{1, 2, 1, 2}, std::nullopt, {"plus_two_cfg_zero_cond_t"}, std::nullopt, "edit_qwenimage_zero_cond_t"},
      {ParallelDims{1, 1, 2, 2}, std::nullopt, {"plus_three_cfg"}, std::nullopt, "edit_qwenimage", true},
      {ParallelDims{1, 1, 2, 2}, std::nullopt, {"plus_three", "plus_one_cfg"}, std::nullopt},
      {ParallelDims{2, 1, 1, 2}, std::nullopt, {"plus_three_cfg", "plus_two_cfg"}, std::nullopt},
  };
  if (is_worker()) return qwen_edit_mesh_worker(meshes);
  EXPECT_EQ(run_ranks(4), 0);
}

// The flags reach the pipeline: `generate --image` at TP 2, and Ulysses x ring on 4 ranks.
TEST(EditMeshCli, GoldenKleinTwoReferencesOnTwoAndFourRanks) {
  if (is_worker()) return;
  const PipelineCase golden = shardit::testing::read_edit_case("edit_flux2_klein", "refs_ab");
  for (const auto& [launch, flags] : std::vector<std::pair<std::string, std::string>>{
           {"--nproc-per-node 2", "--tp 2"}, {"--nproc-per-node 4", "--ulysses 2 --ring 2"}}) {
    const auto run = shardit::testing::run_generate_cli(golden, launch, flags);
    shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, "CLI " + launch + " " + flags);
    shardit::testing::expect_pngs_match(golden, run.pngs, "CLI PNG " + launch + " " + flags);
  }
}

}  // namespace
}  // namespace test_edit_meshes
