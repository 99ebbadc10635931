// The pipelines with the transformer under real tensor parallelism: ranks at TP=2 and 4 (separate
// processes) reproduce diffusers' golden pipeline runs (latents after every step, image, PNG)
// through the C++ API (sharded while loading, and loaded whole then enable_parallelism) and
// through `shardit generate --nproc-per-node`. The golden transformers have 4 heads (TP 2 or 4);
// the built-in tiny pipeline has 12, so TP=3 is checked against TP=1 there.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "shardit/core/cpu_features.h"
#include "shardit/dist/world.h"
#include "shardit/io/png.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/nn/cpu/blas_core.h"
#include "shardit/nn/gemm.h"
#include "shardit/nn/linear.h"
#include "shardit/pipelines/pipeline.h"
#include "shardit/pipelines/auto_pipeline.h"
#include "shardit/pipelines/prompt_encoders.h"
#include "shardit/parallel/parallel_dims.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_pipelines {
namespace {

using shardit::parallel::ParallelDims;
using shardit::testing::env_or;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;

// Prompts with capitals, digits and punctuation, one longer than the other (padding differs).
const std::vector<std::string> kEncoderPrompts = {"A red fox, sleeping in the snow!",
                                                  "2 old robots reading books in a quiet library at night"};
constexpr int64_t kEncoderMaxLength = 24;

void api_worker() {
  auto& world = shardit::dist::World::init();
  shardit::testing::PipelineCase golden = shardit::testing::read_pipeline_case(env_or("SHARDIT_PIPELINE_CASE"));
  const std::string path = env_or("SHARDIT_PIPELINE_PATH");
  shardit::pipelines::PipelineLoadOptions options;
  if (path == "shard-on-load") options.parallel = shardit::parallel::ParallelDims{1, 1, 1, 0}.build(world);
  const auto pipeline = shardit::pipelines::DiffusionPipeline::from_pretrained(golden.dir, options);
  if (path == "enable-parallelism") {
    pipeline->transformer()->enable_parallelism(shardit::testing::world_tensor_parallel());
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
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_flux2_dev", "pipeline_qwenimage"),
                         [](const auto& info) { return info.param.substr(9); });

// One `shardit generate` run on the built-in pipeline into `dir`/`name`.png (+ .safetensors),
// with `env` ("NAME=value ") in front of the command: the image as float [1, H, W, 3] and as PNG
// levels, and what the command printed.
struct BuiltinRun {
  at::Tensor image;
  at::Tensor png;
  std::string output;
};
BuiltinRun generate_builtin(const std::string& dir, const std::string& name, const std::string& options,
                            const std::string& env = "") {
  const std::string command = env + shardit::testing::cli_path() + " generate " + options +
                              " --height 64 --width 96 --steps 3 --seed 7 --out " + dir + "/" + name +
                              ".png --out-tensors " + dir + "/" + name + ".safetensors";
  BuiltinRun run;
  EXPECT_EQ(shardit::testing::run_command(command, &run.output), 0) << run.output;
  run.image = shardit::io::SafetensorsFile::open(dir + "/" + name + ".safetensors")->read("image");
  run.png = shardit::io::read_png(dir + "/" + name + ".png").to(at::kInt);
  return run;
}

// The built-in pipeline (12 heads) at TP=3 and on 2 ranks with --tp 1 (replicas) against one
// rank: the same image up to the order of fp32 sums, the same PNG up to one level.
TEST(PipelinesBuiltin, Tp3AndReplicasMatchTp1) {
  if (is_worker()) return;
  const std::string dir = shardit::testing::make_temp_dir("pipeline-builtin");
  const auto builtin = shardit::models::write_builtin_model(dir + "/model");
  const std::string model = "--model " + builtin.pipeline + " --prompt-embeds " + builtin.prompt_embeds;
  const BuiltinRun tp1 = generate_builtin(dir, "tp1", model);
  EXPECT_EQ(tp1.image.sizes(), (std::vector<int64_t>{1, 64, 96, 3}));
  // TP=3 differs only by the order of fp32 sums in the rowwise layers; replicas run TP=1 each with
  // fewer intra-op threads.
  for (const auto& [name, options] :
       {std::pair<std::string, std::string>{"tp3", "--nproc-per-node 3"}, {"replicas", "--nproc-per-node 2 --tp 1"}}) {
    const BuiltinRun run = generate_builtin(dir, name, options + " " + model);
    EXPECT_TRUE(shardit::testing::tensors_close(name + " image", run.image, tp1.image, 1e-4, 0));
    EXPECT_LE((run.png - tp1.png).abs().max().item<int>(), 1) << name;
  }
}

// generate_batch (the server's dynamic batching) against generate() of each request alone, on
// every rank of the world: the same latents and image bits. Requests: two prompts of different
// token counts, each twice with its own seed, the last with two images; SHARDIT_BATCH_CASES names
// the golden prompt cases, or "builtin". FLUX.1 and FLUX.2 pad every prompt to
// max_sequence_length (one batch of four); Qwen-Image keeps each prompt's length (two batches).
void batch_worker() {
  auto& world = shardit::dist::World::init();
  std::stringstream cases(env_or("SHARDIT_BATCH_CASES"));
  for (std::string name; std::getline(cases, name, ',');) {
    shardit::pipelines::GenerateRequest base;
    std::string dir;
    if (name == "builtin") {
      dir = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("batch-builtin") + "/model").pipeline;
      base.height = 64;
      base.width = 48;
      base.num_inference_steps = 2;
      base.max_sequence_length = kEncoderMaxLength;
    } else {
      const shardit::testing::PipelineCase golden = shardit::testing::read_prompt_case(name);
      dir = golden.dir;
      base = golden.request;
      base.latents.reset();
      base.callback_on_step_end = nullptr;
    }
    base.notes = false;
    shardit::pipelines::PipelineLoadOptions options;
    if (world.size() > 1) options.parallel = shardit::parallel::ParallelDims{1, 1, 1, 0}.build(world);
    const auto pipeline = shardit::pipelines::DiffusionPipeline::from_pretrained(dir, options);
    std::vector<shardit::pipelines::GenerateRequest> requests;
    for (int i = 0; i < 4; ++i) {
      shardit::pipelines::GenerateRequest request = base;
      request.prompt = {kEncoderPrompts[i % 2]};
      if (!base.negative_prompt.empty()) request.negative_prompt = {base.negative_prompt[i % base.negative_prompt.size()]};
      request.seed = 11 + static_cast<uint64_t>(i);
      request.num_images_per_prompt = i == 3 ? 2 : 1;
      requests.push_back(request);
    }
    std::vector<std::vector<size_t>> batches;
    const auto results = pipeline->generate_batch(requests, [&](const std::vector<size_t>& members, int64_t done,
                                                                int64_t) {
      if (done == 0) batches.push_back(members);
      return false;
    });
    const std::string what = name + " at TP=" + std::to_string(world.size());
    if (name == "pipeline_qwenimage") {
      EXPECT_EQ(batches, (std::vector<std::vector<size_t>>{{0, 2}, {1, 3}})) << what;
    } else {
      EXPECT_EQ(batches, (std::vector<std::vector<size_t>>{{0, 1, 2, 3}})) << what;
    }
    const shardit::nn::SamplewiseProducts samplewise;
    for (size_t i = 0; i < requests.size(); ++i) {
      ASSERT_TRUE(results[i].has_value()) << what;
      const auto alone = pipeline->generate(requests[i]);
      EXPECT_TRUE(at::equal(results[i]->latents, alone.latents)) << what << ": request " << i << "'s latents";
      EXPECT_EQ(results[i]->image.defined(), alone.image.defined()) << what;
      if (alone.image.defined()) {
        EXPECT_EQ(results[i]->image.size(0), requests[i].num_images_per_prompt) << what;
        EXPECT_TRUE(at::equal(results[i]->image, alone.image)) << what << ": request " << i << "'s image";
      }
    }
  }
}

TEST(PipelinesBatch, GoldenBatchedRequestsEqualEachAloneAtTp1AndTp2) {
  if (is_worker()) return batch_worker();
  const std::string cases = "pipeline_flux1,pipeline_flux2_klein,pipeline_qwenimage";
  EXPECT_EQ(run_ranks(1, {{"SHARDIT_BATCH_CASES", cases}}), 0);
  EXPECT_EQ(run_ranks(2, {{"SHARDIT_BATCH_CASES", cases}}), 0);
}

// Three ranks sum the rowwise layers' partial products in an order that depends on the tensor's
// size: each sample's all-reduce runs alone too.
TEST(PipelinesBatch, BatchedRequestsEqualEachAloneAtTp3) {
  if (is_worker()) return batch_worker();
  EXPECT_EQ(run_ranks(3, {{"SHARDIT_BATCH_CASES", "builtin"}}), 0);
}

// Busy processes that load every core while they live (killed when it goes).
class CoreLoad {
 public:
  explicit CoreLoad(int processes) {
    for (int i = 0; i < processes; ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        volatile uint64_t spin = 0;
        for (;;) spin = spin + 1;
      }
      if (pid > 0) pids_.push_back(pid);
    }
  }
  ~CoreLoad() {
    for (const pid_t pid : pids_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  CoreLoad(const CoreLoad&) = delete;
  CoreLoad& operator=(const CoreLoad&) = delete;

 private:
  std::vector<pid_t> pids_;
};

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The same command on the same machine gives the same bits whatever the load: `auto` takes the
// GEMM kernel from what the machine is (cpuid, the BLAS library's core), never from a timing, and
// OpenBLAS's core is set from cpuid (nn::cpu::run_on_cpu_blas_kernels). Ten
// runs of one `generate` at 256x256 (its products are large enough for auto to route them) while
// two busy processes load the cores: the PNG bytes and the tensors equal the first run's. The runs
// wait for their OpenMP threads passively (OMP_WAIT_POLICY, which changes no arithmetic): a thread
// spinning at a barrier while its partner waits for a core makes each run 6x slower here.
TEST(PipelinesBuiltin, TenRunsUnderLoadAreBitIdentical) {
  if (is_worker()) return;
  const std::string dir = shardit::testing::make_temp_dir("pipeline-builtin-determinism");
  const auto builtin = shardit::models::write_builtin_model(dir + "/model");
  const CoreLoad load(2);
  std::string first_png;
  at::Tensor first_image, first_latents;
  for (int run = 0; run < 10; ++run) {
    const std::string out = dir + "/run" + std::to_string(run);
    std::string output;
    ASSERT_EQ(shardit::testing::run_command("OMP_WAIT_POLICY=passive " + shardit::testing::cli_path() +
                                                " generate --model " + builtin.pipeline +
                                                " --prompt-embeds " + builtin.prompt_embeds +
                                                " --height 256 --width 256 --steps 2 --seed 3 --out " + out +
                                                ".png --out-tensors " + out + ".safetensors",
                                            &output),
              0)
        << output;
    const auto tensors = shardit::io::SafetensorsFile::open(out + ".safetensors");
    if (run == 0) {
      EXPECT_THAT(output, ::testing::HasSubstr("fp32 matrix products on")) << "the kernel is not reported";
      // The CLI runs the BLAS kernels this test process runs (the same environment, the same
      // decision from cpuid).
      const std::string core = shardit::nn::cpu::blas_core_name();
      if (!core.empty()) {
        EXPECT_THAT(output, ::testing::HasSubstr("BLAS core " + core));
      }
      first_png = file_bytes(out + ".png");
      first_image = tensors->read("image");
      first_latents = tensors->read("latents");
      ASSERT_FALSE(first_png.empty());
      continue;
    }
    EXPECT_EQ(file_bytes(out + ".png"), first_png) << "run " << run << ": the PNG differs from run 0's";
    EXPECT_TRUE(at::equal(tensors->read("image"), first_image)) << "run " << run << ": the image differs";
    EXPECT_TRUE(at::equal(tensors->read("latents"), first_latents)) << "run " << run << ": the latents differ";
  }
}

// OpenBLAS's core follows the CPU: with nothing set, a program whose OpenBLAS chose a narrower core
// than cpuid's vector set runs again on the right one (nn::cpu::run_on_cpu_blas_kernels) and says so
// on its kernel line; a core the user sets with OPENBLAS_CORETYPE is kept.
TEST(PipelinesBuiltin, BlasCoreFollowsTheCpuUnlessTheUserSetsOne) {
  if (is_worker()) return;
  if (shardit::nn::cpu::blas_core_name().empty()) GTEST_SKIP() << "the BLAS library is not OpenBLAS";
  const std::string dir = shardit::testing::make_temp_dir("pipeline-builtin-blas-core");
  const auto builtin = shardit::models::write_builtin_model(dir + "/model");
  const std::string model = "--model " + builtin.pipeline + " --prompt-embeds " + builtin.prompt_embeds;
  const auto core_of = [](const std::string& output) {
    std::smatch match;
    static const std::regex core_re("BLAS core ([A-Za-z0-9]+)");
    EXPECT_TRUE(std::regex_search(output, match, core_re)) << output;
    return match.size() > 1 ? match[1].str() : std::string();
  };
  const BuiltinRun chosen =
      generate_builtin(dir, "chosen", model, "env -u OPENBLAS_CORETYPE -u SHARDIT_KEEP_BLAS_CORE ");
  const int cpu_level = shardit::nn::cpu::cpu_vector_level();
  const std::string core = core_of(chosen.output);
  EXPECT_GE(shardit::nn::cpu::blas_vector_level(core), std::min(cpu_level, 3)) << "OpenBLAS runs " << core << " on a CPU with "
                                                                     << shardit::cpu_features().to_string();
  if (cpu_level >= 2) {
    const BuiltinRun kept = generate_builtin(dir, "kept", model, "env -u SHARDIT_KEEP_BLAS_CORE OPENBLAS_CORETYPE=Haswell ");
    EXPECT_EQ(core_of(kept.output), "Haswell");
  }
}

// The quick start: `generate --prompt` with no --model (the built-in pipeline written under
// TMPDIR, text encoders included) on one rank and on two (transformer and text encoders at TP=2):
// the same image up to the order of fp32 sums; another prompt gives another image.
TEST(PipelinesBuiltin, PromptWithoutModelTp2MatchesTp1) {
  if (is_worker()) return;
  const std::string dir = shardit::testing::make_temp_dir("pipeline-builtin-prompt");
  const std::string env = "TMPDIR=" + dir + " ";
  const std::string prompt = "--prompt 'A red fox, sleeping in the snow!' --max-sequence-length 32";
  const BuiltinRun tp1 = generate_builtin(dir, "tp1", prompt, env);
  EXPECT_THAT(tp1.output, ::testing::HasSubstr("built-in tiny"));
  const BuiltinRun tp2 =
      generate_builtin(dir, "tp2", "--nproc-per-node 2 " + prompt + " --compare-to " + dir + "/tp1.png", env);
  EXPECT_THAT(tp2.output, ::testing::HasSubstr("tp 2 of 2 ranks"));
  EXPECT_THAT(tp2.output, ::testing::HasSubstr("the image equals"));
  EXPECT_THAT(tp2.output, ::testing::Not(::testing::HasSubstr("text encoders run at tensor-parallel degree")))
      << "the text encoders run at the transformer's degree";
  EXPECT_TRUE(shardit::testing::tensors_close("image at TP=2", tp2.image, tp1.image, 1e-4, 0));
  const BuiltinRun other =
      generate_builtin(dir, "other", "--prompt 'a blue whale under the ocean at night' --max-sequence-length 32", env);
  EXPECT_GT((other.image - tp1.image).abs().max().item<double>(), 1e-3) << "the prompt does not change the image";
}

// The built-in pipeline's text encoders sharded over the world encode prompts as on one rank.
void builtin_encoder_worker() {
  auto& world = shardit::dist::World::init();
  shardit::pipelines::TextEncoderLoadOptions options;
  options.tp_degree = world.size();
  const auto encoder = shardit::pipelines::load_prompt_encoder(
      shardit::io::ModelFolder::open(env_or("SHARDIT_BUILTIN_MODEL")), "FluxPipeline",
      shardit::pipelines::pipeline_class("FluxPipeline", "test").prompt_encoder, options);
  const auto embeds = encoder->encode(kEncoderPrompts, kEncoderMaxLength);
  const auto reference = shardit::io::SafetensorsFile::open(env_or("SHARDIT_BUILTIN_REFERENCE"));
  for (const auto& [name, value] : {std::pair<std::string, at::Tensor>{"prompt_embeds", embeds.prompt_embeds},
                                    {"pooled_prompt_embeds", embeds.pooled_prompt_embeds.value()}}) {
    const at::Tensor expected = reference->read(name);
    // As in the encoder TP tests: only the order of fp32 sums differs, ~1e-6 of the scale.
    EXPECT_TRUE(shardit::testing::tensors_close(name + " at TP=" + std::to_string(world.size()), value, expected,
                                                1e-5 * std::max(expected.abs().max().item<double>(), 1.0), 0));
  }
}

TEST(PipelinesBuiltin, PromptEncodingTp2AndTp3MatchTp1) {
  if (is_worker()) return builtin_encoder_worker();
  const std::string dir = shardit::testing::make_temp_dir("pipeline-builtin-encode");
  const auto builtin = shardit::models::write_builtin_model(dir + "/model");
  shardit::pipelines::TextEncoderLoadOptions options;
  options.tp_degree = 1;
  const auto encoder = shardit::pipelines::load_prompt_encoder(
      shardit::io::ModelFolder::open(builtin.pipeline), "FluxPipeline",
      shardit::pipelines::pipeline_class("FluxPipeline", "test").prompt_encoder, options);
  const auto embeds = encoder->encode(kEncoderPrompts, kEncoderMaxLength);
  ASSERT_EQ(embeds.prompt_embeds.sizes(), (std::vector<int64_t>{2, kEncoderMaxLength, 64}));
  ASSERT_EQ(embeds.pooled_prompt_embeds.value().sizes(), (std::vector<int64_t>{2, 96}));
  EXPECT_GT((embeds.pooled_prompt_embeds.value()[0] - embeds.pooled_prompt_embeds.value()[1]).abs().max().item<double>(),
            1e-2)
      << "two prompts, one pooled embedding";
  EXPECT_TRUE(at::isfinite(embeds.prompt_embeds).all().item<bool>());
  const std::string reference = dir + "/reference.safetensors";
  shardit::io::save_safetensors(reference, {{"prompt_embeds", embeds.prompt_embeds},
                                            {"pooled_prompt_embeds", embeds.pooled_prompt_embeds.value()}});
  for (const int nproc : {2, 3}) {
    EXPECT_EQ(run_ranks(nproc, {{"SHARDIT_BUILTIN_MODEL", builtin.pipeline}, {"SHARDIT_BUILTIN_REFERENCE", reference}}),
              0)
        << "TP=" << nproc;
  }
}

// LoRA owned by the pipeline, from the command line: the golden FLUX.1 pipeline with the golden
// PEFT adapter (written for a transformer whose blocks have this pipeline's widths; it targets
// only block Linears). The adapter changes the image; merging it (--fuse-lora) gives the unfused
// image up to fp32 rounding; weight 0 gives the base image bit for bit (the unfused delta is
// skipped at weight 0, as it is with no adapter); TP=2 shards the adapter with the transformer.
TEST(PipelineLora, GoldenGenerateLoraFuseZeroWeightAndTp2) {
  if (is_worker()) return;
  const auto golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path("pipeline_flux1"));
  const std::string lora = "--lora " + shardit::testing::golden_path("lora_flux1_peft/pixel.safetensors");
  // One GEMM kernel for every run: `auto` times BLAS against oneDNN in each process, and the
  // bit-for-bit comparison must not depend on which one a loaded machine picked.
  const std::string blas = "--gemm-backend blas";
  const auto base = shardit::testing::run_generate_cli(golden, blas);
  const auto unfused = shardit::testing::run_generate_cli(golden, blas, lora + ":0.8");
  const auto fused = shardit::testing::run_generate_cli(golden, blas, lora + ":0.8 --fuse-lora");
  const auto zero = shardit::testing::run_generate_cli(golden, blas, lora + ":0");
  const auto tp2 = shardit::testing::run_generate_cli(golden, blas + " --nproc-per-node 2", lora + ":0.8");
  ASSERT_TRUE(base.image.defined() && unfused.image.defined() && fused.image.defined() && zero.image.defined() &&
              tp2.image.defined());
  EXPECT_GT((unfused.image - base.image).abs().max().item<double>(), 1e-3) << "the adapter does not change the image";
  EXPECT_TRUE(shardit::testing::tensors_close("--fuse-lora against unfused", fused.image, unfused.image, 1e-5, 0));
  EXPECT_TRUE(at::equal(zero.image, base.image)) << "weight 0 is not the base image bit for bit";
  EXPECT_TRUE(at::equal(zero.latents, base.latents)) << "weight 0 does not give the base latents bit for bit";
  EXPECT_NE(tp2.output.find("tp 2 of 2 ranks"), std::string::npos) << tp2.output;
  EXPECT_TRUE(shardit::testing::tensors_close("LoRA at TP=2 against TP=1", tp2.image, unfused.image,
                                              shardit::testing::kImageAtol, 0));
}

// A text-encoder degree the encoders' heads do not allow is refused by load() before any weight is
// read: the golden FLUX.1 encoders have 4 heads, so --text-encoder-tp 3 on 3 ranks fails naming
// the encoder, and the transformer is still unloaded.
TEST(PipelinesErrors, GoldenTextEncoderDegreeIsRefusedBeforeAnyLoad) {
  if (is_worker()) {
    shardit::dist::World::init();
    shardit::pipelines::PipelineLoadOptions options;
    options.text_encoder_tp = 3;
    const auto pipeline =
        shardit::pipelines::DiffusionPipeline::open(shardit::testing::golden_path("pipeline_flux1"), options);
    const std::string error = shardit::testing::error_of([&] { pipeline->load(); });
    EXPECT_EQ(error,
              "FluxPipeline's text_encoder (CLIPTextModel) cannot run at --text-encoder-tp 3: num_attention_heads = "
              "4, which does not divide by tp_degree 3; degrees that would work (up to 64): 1, 2, 4");
    EXPECT_EQ(pipeline->transformer()->resolved_plan(), nullptr) << "the transformer loaded before the check";
    EXPECT_FALSE(pipeline->loaded());
    return;
  }
  EXPECT_EQ(run_ranks(3), 0);
}

}  // namespace
}  // namespace test_pipelines
