// CFG-parallel on the cfg x ulysses x ring x tp mesh, in real multi-process runs: the two halves of
// the cfg dimension each run one branch of classifier-free guidance (the conditional on cfg index
// 0, the unconditional on 1, each on its own tp group), exchange the predictions and combine them
// alike, so every rank keeps the same latents. The golden pipelines with CFG (Qwen-Image's true
// CFG with the norm rescale, FLUX.2 klein's CFG) give diffusers' latents after every step, image
// and PNGs under cfg=2 (2 ranks) and cfg=2 x tp=2 (4 ranks), through the API and `shardit
// generate --cfg-parallel`; FLUX.1's true CFG (no golden run has it) gives the single-rank run's.
// Each rank runs the transformer once per step, on its own branch, where one rank runs it twice.
// Requests and pipelines without CFG are refused with their messages.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/nn/module.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/pipelines/pipeline.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_cfg_parallel {
namespace {

namespace fs = std::filesystem;
using shardit::parallel::ParallelDims;
using shardit::pipelines::DiffusionPipeline;
using shardit::pipelines::GenerateRequest;
using shardit::pipelines::PipelineLoadOptions;
using shardit::testing::env_or;
using shardit::testing::error_of;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;

/// The text length of every transformer call made while it lives, read from the transformer's
/// top-level emit of its embedded text (`text_emit`, [B, L, D]): one entry per call.
class TransformerCalls {
 public:
  explicit TransformerCalls(std::string text_emit)
      : text_emit_(std::move(text_emit)),
        observe_([this](const std::string& path, const std::string& name, const at::Tensor& value) {
          if (path.empty() && name == text_emit_) lengths.push_back(value.size(1));
        }) {}
  std::vector<int64_t> lengths;

 private:
  std::string text_emit_;
  shardit::nn::ObserveForward observe_;
};

/// The emit that marks one transformer call of each golden pipeline with CFG.
std::string text_emit_of(const std::string& pipeline_class) {
  if (pipeline_class == "QwenImagePipeline") return "txt_norm";
  return "context_embedder";  // Flux2Transformer2DModel, FluxTransformer2DModel
}

/// Every rank's tensor equals rank 0's, bit for bit.
void expect_same_on_every_rank(const at::Tensor& tensor, const std::string& what) {
  auto& world = shardit::dist::World::get();
  const at::Tensor all = world.group()->all_gather(tensor.contiguous().unsqueeze(0), 0);
  for (int r = 1; r < world.size(); ++r) EXPECT_TRUE(at::equal(all[r], all[0])) << what << ": rank " << r;
}

void golden_worker() {
  auto& world = shardit::dist::World::init();
  shardit::testing::PipelineCase golden = shardit::testing::read_pipeline_case(env_or("SHARDIT_PIPELINE_CASE"));
  const ParallelDims dims = ParallelDims{2, 1, 1, 0}.resolved(world.size());
  PipelineLoadOptions options;
  options.parallel = dims.build(world);
  options.load_text_encoders = false;
  const auto pipeline = DiffusionPipeline::from_pretrained(golden.dir, options);
  ASSERT_EQ(pipeline->transformer()->tp_degree(), dims.tp);
  EXPECT_EQ(pipeline->parallel_dims(), dims);
  ASSERT_TRUE(pipeline->runs_cfg(golden.request));
  std::vector<at::Tensor> steps;
  golden.request.callback_on_step_end = [&steps](int64_t, const at::Tensor& latents) {
    steps.push_back(latents.clone());
  };
  TransformerCalls calls(text_emit_of(pipeline->class_name()));
  const auto result = pipeline->generate(golden.request);
  const std::string what = golden.dir + " (API, " + dims.to_string() + ")";
  EXPECT_TRUE(result.cfg) << what;

  // One transformer call per step on this rank (one rank alone makes two), on this half's branch.
  const int cfg_index = options.parallel.mesh->coordinate("cfg");
  EXPECT_EQ(static_cast<int64_t>(calls.lengths.size()), golden.steps) << what;
  const int64_t cond_length = golden.request.prompt_embeds->prompt_embeds.size(1);
  const int64_t uncond_length = golden.request.negative_prompt_embeds->prompt_embeds.size(1);
  if (cond_length != uncond_length) {
    for (const int64_t length : calls.lengths)
      EXPECT_EQ(length, cfg_index == 0 ? cond_length : uncond_length) << what << ": cfg index " << cfg_index;
  }

  ASSERT_EQ(static_cast<int64_t>(steps.size()), golden.steps) << what;
  for (const auto& latents : steps) expect_same_on_every_rank(latents, what + ": latents");
  if (world.rank() == 0) {
    shardit::testing::expect_pipeline_matches(golden, steps, result.image, what);
  } else {
    EXPECT_FALSE(result.image.defined());
    const auto outputs = shardit::io::SafetensorsFile::open(golden.dir + "/outputs.safetensors");
    for (int64_t k = 0; k < golden.steps; ++k) {
      const std::string name = "step" + std::to_string(k) + ".latents";
      EXPECT_TRUE(shardit::testing::tensors_close(what + ": " + name, steps[static_cast<size_t>(k)],
                                                  outputs->read(name), shardit::testing::kPipelineAtol,
                                                  shardit::testing::kPipelineRtol));
    }
  }
}

class CfgParallel : public ::testing::TestWithParam<std::string> {};

TEST_P(CfgParallel, ApiCfg2) {
  if (is_worker()) return golden_worker();
  EXPECT_EQ(run_ranks(2, {{"SHARDIT_PIPELINE_CASE", shardit::testing::golden_path(GetParam())}}), 0);
}

// The golden transformers have 4 heads: each cfg half shards its transformer over 2 ranks.
TEST_P(CfgParallel, ApiCfg2Tp2) {
  if (is_worker()) return golden_worker();
  EXPECT_EQ(run_ranks(4, {{"SHARDIT_PIPELINE_CASE", shardit::testing::golden_path(GetParam())}}), 0);
}

TEST_P(CfgParallel, CliCfg2) {
  if (is_worker()) return;
  auto golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path(GetParam()));
  golden.cli_args.push_back("--cfg-parallel");
  const auto run = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2");
  EXPECT_NE(run.output.find("tp 1 of 2 ranks, mesh cfg=2 x ulysses=1 x ring=1 x tp=1"), std::string::npos)
      << run.output;
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, GetParam() + " (CLI, cfg=2)");
  shardit::testing::expect_pngs_match(golden, run.pngs, GetParam() + " (CLI PNG, cfg=2)");
}

INSTANTIATE_TEST_SUITE_P(Golden, CfgParallel, ::testing::Values("pipeline_qwenimage", "pipeline_flux2_klein"),
                         [](const auto& info) { return info.param.substr(9); });

TEST(CfgParallelCli, GoldenQwenImageCfg2Tp2On4Ranks) {
  if (is_worker()) return;
  auto golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path("pipeline_qwenimage"));
  golden.cli_args.push_back("--cfg-parallel");
  const auto run = shardit::testing::run_generate_cli(golden, "--nproc-per-node 4");
  EXPECT_NE(run.output.find("tp 2 of 4 ranks, mesh cfg=2 x ulysses=1 x ring=1 x tp=2"), std::string::npos)
      << run.output;
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image,
                                            "pipeline_qwenimage (CLI, cfg=2 x tp=2)");
  shardit::testing::expect_pngs_match(golden, run.pngs, "pipeline_qwenimage (CLI PNG, cfg=2 x tp=2)");
}

// FLUX.1's true CFG (true_cfg_scale > 1 with a negative prompt; no golden run has it): the golden
// pipeline with a made-up negative prompt, under cfg=2 (x tp), against the same request on one
// rank loaded whole. Tolerance: the golden one; the runs differ only in the order of fp32 sums
// (TP's rowwise all-reduce, the ranks' intra-op threads).
void flux_true_cfg_worker() {
  auto& world = shardit::dist::World::init();
  shardit::testing::PipelineCase golden =
      shardit::testing::read_pipeline_case(shardit::testing::golden_path("pipeline_flux1"));
  GenerateRequest& request = golden.request;
  const auto& positive = *request.prompt_embeds;
  request.negative_prompt_embeds =
      shardit::pipelines::PromptEmbeds{positive.prompt_embeds.roll(1, 1) * 0.5, positive.pooled_prompt_embeds->flip(-1),
                                       std::nullopt};
  request.true_cfg_scale = 3.0;

  const auto run = [&](const PipelineLoadOptions& options, std::vector<at::Tensor>& steps, int64_t& calls_made) {
    const auto pipeline = DiffusionPipeline::from_pretrained(golden.dir, options);
    request.callback_on_step_end = [&steps](int64_t, const at::Tensor& latents) { steps.push_back(latents.clone()); };
    TransformerCalls calls(text_emit_of(pipeline->class_name()));
    auto result = pipeline->generate(request);
    calls_made = static_cast<int64_t>(calls.lengths.size());
    EXPECT_TRUE(result.cfg);
    return result;
  };
  PipelineLoadOptions whole;
  whole.load_text_encoders = false;
  whole.load_vae = true;
  std::vector<at::Tensor> reference_steps;
  int64_t reference_calls = 0;
  const auto reference = run(whole, reference_steps, reference_calls);
  EXPECT_EQ(reference_calls, 2 * golden.steps) << "one rank runs both branches";

  const ParallelDims dims = ParallelDims{2, 1, 1, 0}.resolved(world.size());
  PipelineLoadOptions options;
  options.parallel = dims.build(world);
  options.load_text_encoders = false;
  std::vector<at::Tensor> steps;
  int64_t calls = 0;
  const auto result = run(options, steps, calls);
  const std::string what = "FLUX.1 true CFG (" + dims.to_string() + ")";
  EXPECT_EQ(calls, golden.steps) << what << ": half the single-rank transformer calls";
  ASSERT_EQ(steps.size(), reference_steps.size());
  for (size_t k = 0; k < steps.size(); ++k) {
    EXPECT_TRUE(shardit::testing::tensors_close(what + ": step" + std::to_string(k) + ".latents", steps[k],
                                                reference_steps[k], shardit::testing::kPipelineAtol,
                                                shardit::testing::kPipelineRtol));
    expect_same_on_every_rank(steps[k], what + ": latents");
  }
  if (world.rank() == 0) {
    EXPECT_TRUE(shardit::testing::tensors_close(what + ": image", result.image, reference.image,
                                                shardit::testing::kImageAtol, 0));
  }
}

TEST(CfgParallelFlux, GoldenTrueCfgCfg2MatchesOneRank) {
  if (is_worker()) return flux_true_cfg_worker();
  EXPECT_EQ(run_ranks(2), 0);
}

TEST(CfgParallelFlux, GoldenTrueCfgCfg2Tp2MatchesOneRank) {
  if (is_worker()) return flux_true_cfg_worker();
  EXPECT_EQ(run_ranks(4), 0);
}

/// One small step of the built-in pipeline, from its prompt embeddings (no negative prompt).
GenerateRequest builtin_request() {
  GenerateRequest request;
  request.prompt_embeds = shardit::pipelines::read_prompt_embeds(env_or("SHARDIT_BUILTIN_EMBEDS"));
  request.height = 32;
  request.width = 32;
  request.num_inference_steps = 1;
  request.notes = false;
  return request;
}

// A request that runs no CFG under cfg=2 is refused by check() (before any weight is read), and by
// generate(); the same request with a negative prompt passes.
TEST(CfgParallelErrors, RefusesRequestWithoutCfg) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    PipelineLoadOptions options;
    options.parallel = ParallelDims{2, 1, 1, 0}.build(world);
    const auto pipeline = DiffusionPipeline::open(env_or("SHARDIT_BUILTIN_PIPELINE"), options);
    GenerateRequest request = builtin_request();
    const std::string expected =
        "FluxPipeline: CFG-parallel (cfg 2, --cfg-parallel) runs the conditional and unconditional branches of "
        "classifier-free guidance on the two halves of the mesh, but this request runs no CFG (FluxPipeline runs "
        "true CFG when true_cfg_scale (default 1) > 1 and a negative prompt is given); drop --cfg-parallel, or ask "
        "for CFG";
    EXPECT_EQ(error_of([&] { pipeline->check(request); }), expected);
    request.negative_prompt_embeds = request.prompt_embeds;
    EXPECT_EQ(error_of([&] { pipeline->check(request); }), expected) << "a negative prompt without true_cfg_scale";
    EXPECT_FALSE(pipeline->loaded());
    request.true_cfg_scale = 2.0;
    pipeline->check(request);
    request.negative_prompt_embeds.reset();
    pipeline->load();
    EXPECT_EQ(error_of([&] { pipeline->generate(request); }), expected);
    return;
  }
  const auto builtin =
      shardit::models::write_builtin_model(shardit::testing::make_temp_dir("cfg-builtin") + "/model");
  EXPECT_EQ(run_ranks(2, {{"SHARDIT_BUILTIN_PIPELINE", builtin.pipeline},
                          {"SHARDIT_BUILTIN_EMBEDS", builtin.prompt_embeds}}),
            0);
}

// FLUX.2 klein distilled runs no CFG: CFG-parallel is refused when the pipeline is opened.
TEST(CfgParallelErrors, GoldenRefusesDistilledKlein) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    PipelineLoadOptions options;
    options.parallel = ParallelDims{2, 1, 1, 0}.build(world);
    EXPECT_EQ(error_of([&] { DiffusionPipeline::open(env_or("SHARDIT_DISTILLED_KLEIN"), options); }),
              "Flux2KleinPipeline: CFG-parallel (cfg 2, --cfg-parallel) runs the conditional and unconditional "
              "branches of classifier-free guidance on the two halves of the mesh, but this pipeline runs no CFG "
              "(Flux2KleinPipeline runs CFG when guidance_scale (default 4) > 1 and the model is not distilled "
              "(model_index.json: is_distilled true)); drop --cfg-parallel");
    return;
  }
  // The golden klein folder with is_distilled set: links to its components, a new model_index.json.
  const std::string source = shardit::testing::golden_path("pipeline_flux2_klein");
  const std::string dir = shardit::testing::make_temp_dir("klein-distilled");
  for (const auto& entry : fs::directory_iterator(source)) {
    if (entry.is_directory()) fs::create_directory_symlink(entry.path(), dir + "/" + entry.path().filename().string());
  }
  nlohmann::json index = shardit::io::read_json_file(source + "/model_index.json");
  index["is_distilled"] = true;
  std::ofstream(dir + "/model_index.json") << index.dump(2);
  EXPECT_EQ(run_ranks(2, {{"SHARDIT_DISTILLED_KLEIN", dir}}), 0);
}

// A mesh the transformer cannot be split over (the golden Qwen-Image transformer has 4 heads) is
// refused when the pipeline is opened, listing the meshes of the launched ranks it can run on.
TEST(CfgParallelErrors, GoldenRefusesImpossibleSplit) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    const std::string dir = shardit::testing::golden_path("pipeline_qwenimage");
    PipelineLoadOptions tp3;
    tp3.parallel = ParallelDims{1, 1, 1, 3}.build(world);
    EXPECT_EQ(error_of([&] { DiffusionPipeline::open(dir, tp3); }),
              "QwenImagePipeline's transformer cannot run on the mesh cfg=1 x ulysses=1 x ring=1 x tp=3: "
              "num_attention_heads = 4, which does not divide by tp_degree 3; degrees that would work (up to 64): 1, "
              "2, 4; meshes of 3 ranks it can run on: [--ring 3 --tp 1]");
    PipelineLoadOptions ulysses3;
    ulysses3.parallel = ParallelDims{1, 3, 1, 1}.build(world);
    EXPECT_EQ(error_of([&] { DiffusionPipeline::open(dir, ulysses3); }),
              "QwenImagePipeline's transformer cannot run on the mesh cfg=1 x ulysses=3 x ring=1 x tp=1: "
              "QwenImageTransformer2DModel: num_attention_heads = 4 does not divide by tp x ulysses = 1 x 3 = 3 "
              "(each rank must hold whole heads); (tp, ulysses) pairs that work: (1, 1), (1, 2), (2, 1), (1, 4), "
              "(2, 2), (4, 1); the ring degree is free; meshes of 3 ranks it can run on: [--ring 3 --tp 1]");
    return;
  }
  EXPECT_EQ(run_ranks(3), 0);
}

// `shardit generate --cfg-parallel` on a request without CFG stops before loading, with the
// message, on every rank.
TEST(CfgParallelErrors, GoldenCliRefusesRequestWithoutCfg) {
  if (is_worker()) return;
  auto golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path("pipeline_qwenimage"));
  std::vector<std::string> args = golden.cli_args;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--true-cfg-scale") args[i + 1] = "1";
  }
  std::string command = shardit::testing::cli_path() + " --nproc-per-node 2 generate --cfg-parallel";
  for (const auto& arg : args) command += " '" + arg + "'";
  command += " --out " + shardit::testing::make_temp_dir("cfg-cli") + "/out.png";
  std::string output;
  EXPECT_NE(shardit::testing::run_command(command, &output), 0) << output;
  EXPECT_NE(output.find("QwenImagePipeline: CFG-parallel (cfg 2, --cfg-parallel) runs the conditional and "
                        "unconditional branches of classifier-free guidance on the two halves of the mesh, but this "
                        "request runs no CFG (QwenImagePipeline runs true CFG when true_cfg_scale (default 4) > 1 and "
                        "a negative prompt is given); drop --cfg-parallel, or ask for CFG"),
            std::string::npos)
      << output;
}

// A mesh whose product does not divide the ranks stops before anything is read.
TEST(CfgParallelErrors, CliRefusesWrongProduct) {
  if (is_worker()) return;
  std::string output;
  EXPECT_NE(shardit::testing::run_command(shardit::testing::cli_path() +
                                              " --nproc-per-node 2 generate --cfg-parallel --tp 2 --out " +
                                              shardit::testing::make_temp_dir("cfg-cli") + "/out.png",
                                          &output),
            0)
      << output;
  EXPECT_NE(output.find("the parallel mesh cfg 2 (--cfg-parallel) x ulysses 1 (--ulysses) x ring 1 (--ring) x tp 2 "
                        "(--tp) = 4 does not divide the 2 ranks launched; choose degrees whose product is 2 (or "
                        "divides it: each block of that many ranks then runs a replica): [--tp 2], [--ring 2 --tp 1], "
                        "[--ulysses 2 --tp 1], [--cfg-parallel --tp 1]"),
            std::string::npos)
      << output;
}

}  // namespace
}  // namespace test_cfg_parallel
