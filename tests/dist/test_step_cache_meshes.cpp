// Step caching (First-Block Cache, TaylorSeer lite) against diffusers' own hooks, and the same
// decisions on every mesh:
// - the golden cache cases (cache_flux1, cache_qwenimage: diffusers' enable_cache on the golden
//   pipelines, from their prompts, 10 steps): the API on 4-rank meshes (tp 2, tp 4, and FLUX.1
//   ulysses 2 x tp 2 / Qwen-Image cfg 2 x ring 2) gives every per-step decision, the ratios
//   compared and the image (`shardit generate --cache` at one rank: tests/unit/test_step_cache.cpp);
// - FLUX.2 [klein] and [dev], which diffusers cannot cache: threshold 0 is the uncached image bit for bit,
//   and a threshold that skips gives the same decisions and image on every mesh of up to 4 ranks;
// - the reduction behind the ratio: on an uneven Ulysses split, averaging the ranks' means would
//   decide otherwise than the sums over the whole sequence that the cache reduces.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "shardit/dist/world.h"
#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/step_cache.h"
#include "shardit/parallel/context_parallel.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/pipelines/pipeline.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
#include "support/step_cache_case.h"
#include "support/test_support.h"

namespace test_step_cache_meshes {
namespace {

using shardit::models::StepCacheConfig;
using shardit::parallel::ParallelDims;
using shardit::pipelines::DiffusionPipeline;
using shardit::pipelines::GenerateResult;
using shardit::pipelines::PipelineLoadOptions;
using shardit::testing::is_worker;
using shardit::testing::PipelineCase;
using shardit::testing::run_ranks;

using shardit::testing::CacheGolden;
using shardit::testing::expect_cache_case_matches;
using shardit::testing::golden_contexts;
using shardit::testing::kCacheSteps;
using shardit::testing::read_cache_golden;

constexpr int kRanks = 4;

class StepCacheGolden : public ::testing::TestWithParam<std::string> {};

/// Every golden case on `dims` over the world (the API, one pipeline load): decisions on every
/// rank, the image on the first.
void expect_cases_on_mesh(const CacheGolden& golden, const ParallelDims& dims) {
  auto& world = shardit::dist::World::get();
  PipelineLoadOptions options;
  options.parallel = dims.build(world);
  const auto pipeline = DiffusionPipeline::from_pretrained(golden.pipeline.dir, options);
  for (const nlohmann::json& golden_case : golden.cases) {
    shardit::pipelines::GenerateRequest request = golden.pipeline.request;
    request.cache = StepCacheConfig::from_json(golden_case.at("config"));
    const GenerateResult result = pipeline->generate(request);
    const std::string what = golden.dir + " " + golden_case.at("name").get<std::string>() + " (" + dims.to_string() + ")";
    EXPECT_EQ(result.cache_contexts, golden_contexts(golden)) << what;
    expect_cache_case_matches(golden, golden_case, result.cache_contexts, result.cache_computed, result.cache_ratio,
                              world.rank() == 0 ? result.image : at::Tensor(), what);
  }
  // The cache is the request's: off again after the calls.
  EXPECT_EQ(pipeline->joint_transformer().step_cache(), nullptr);
}

TEST_P(StepCacheGolden, ApiMatchesDiffusersHooksOnMeshesOfFourRanks) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    ASSERT_EQ(world.size(), kRanks);
    const CacheGolden golden = read_cache_golden(GetParam());
    const bool cfg = !golden.pipeline.request.negative_prompt.empty();
    // tp 2 (two replicas), tp 4, and a mixed mesh: FLUX.1 ulysses 2 x tp 2, Qwen-Image (CFG)
    // cfg 2 x ring 2.
    std::vector<ParallelDims> meshes = {{1, 1, 1, 2}, {1, 1, 1, 4}};
    meshes.push_back(cfg ? ParallelDims{2, 1, 2, 1} : ParallelDims{1, 2, 1, 2});
    for (const ParallelDims& dims : meshes) {
      SCOPED_TRACE(dims.to_string());
      expect_cases_on_mesh(golden, dims);
    }
    return;
  }
  EXPECT_EQ(run_ranks(kRanks), 0);
}

INSTANTIATE_TEST_SUITE_P(Golden, StepCacheGolden, ::testing::Values("cache_flux1", "cache_qwenimage"),
                         [](const auto& info) { return info.param; });

// FLUX.2 [klein] and [dev]: diffusers registers no cache hooks for FLUX.2's blocks; shardit runs
// the same rules on them. Threshold 0 computes every step and equals the uncached image bit for
// bit; a threshold that skips (chosen from the ratios, at least 2% away from every one compared)
// gives the same decisions and image on every mesh of up to 4 ranks; TaylorSeer likewise. The
// single-rank references are computed once, by the test process, and the ranks read them.
class StepCacheFlux2 : public ::testing::TestWithParam<std::string> {};

/// One generation of a FLUX.2 golden case on `dims` of the world, with `cache` (every rank decodes,
/// so the images compare on each).
GenerateResult generate_flux2_case(const PipelineCase& golden, const ParallelDims& dims,
                                   const std::optional<StepCacheConfig>& cache) {
  PipelineLoadOptions options;
  options.parallel = dims.build(shardit::dist::World::get());
  options.load_vae = true;
  const auto pipeline = DiffusionPipeline::from_pretrained(golden.dir, options);
  auto request = golden.request;
  request.cache = cache;
  return pipeline->generate(request);
}

TEST_P(StepCacheFlux2, SameDecisionsAndImageOnEveryMesh) {
  PipelineCase golden = shardit::testing::read_prompt_case(is_worker() ? shardit::testing::env_or("SHARDIT_PIPELINE_CASE")
                                                                       : GetParam());
  shardit::testing::set_case_steps(golden, kCacheSteps);
  const StepCacheConfig taylor = StepCacheConfig::parse("taylorseer_lite:cache_interval=3,disable_cache_before_step=2");
  const ParallelDims one_rank{1, 1, 1, 1};
  if (!is_worker()) {
    // The single-rank references, once, in this process (the ranks read them from a file).
    shardit::dist::World::init();
    const GenerateResult uncached = generate_flux2_case(golden, one_rank, std::nullopt);
    const GenerateResult never =
        generate_flux2_case(golden, one_rank, StepCacheConfig::parse("first_block_cache:threshold=0"));
    EXPECT_TRUE(at::equal(never.latents, uncached.latents));
    EXPECT_TRUE(at::equal(never.image, uncached.image));
    ASSERT_TRUE(never.cache_computed.defined());
    EXPECT_EQ(never.cache_computed.sum().item<int64_t>(), never.cache_computed.numel());

    // A threshold in the widest gap between the ratios of the never-skipping run whose decisions
    // all stay >= 2% away from it and which skips at least once.
    std::vector<double> ratios;
    const at::Tensor ratio_table = never.cache_ratio.flatten();
    for (int64_t i = 0; i < ratio_table.numel(); ++i) {
      if (!std::isnan(ratio_table[i].item<double>())) ratios.push_back(ratio_table[i].item<double>());
    }
    std::sort(ratios.begin(), ratios.end());
    std::vector<std::pair<double, double>> gaps;  // (width, midpoint)
    for (size_t i = 1; i < ratios.size(); ++i) gaps.emplace_back(ratios[i] - ratios[i - 1], (ratios[i] + ratios[i - 1]) / 2);
    std::sort(gaps.rbegin(), gaps.rend());
    std::optional<double> skipping;
    GenerateResult reference;
    for (const auto& [width, threshold] : gaps) {
      StepCacheConfig config;
      config.method = shardit::models::FirstBlockCacheConfig{threshold};
      GenerateResult result = generate_flux2_case(golden, one_rank, config);
      const at::Tensor compared = result.cache_ratio.flatten();
      double margin = std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < compared.numel(); ++i) {
        const double r = compared[i].item<double>();
        if (!std::isnan(r)) margin = std::min(margin, std::abs(r - threshold) / threshold);
      }
      if (margin >= 0.02 && result.cache_computed.sum().item<int64_t>() < result.cache_computed.numel()) {
        skipping = threshold;
        reference = result;
        break;
      }
    }
    ASSERT_TRUE(skipping.has_value()) << "no threshold skips with a 2% margin on this case";
    const GenerateResult taylor_reference = generate_flux2_case(golden, one_rank, taylor);
    const std::string references = shardit::testing::make_temp_dir("step-cache-flux2") + "/references.safetensors";
    shardit::io::save_safetensors(
        references, {{"threshold", at::tensor({*skipping}, at::kDouble)},
                     {"cfg", at::tensor({static_cast<int64_t>(never.cache_contexts.size() == 2)})},
                     {"computed", reference.cache_computed}, {"latents", reference.latents}, {"image", reference.image},
                     {"taylor.computed", taylor_reference.cache_computed}, {"taylor.latents", taylor_reference.latents}});
    EXPECT_EQ(run_ranks(kRanks, {{"SHARDIT_PIPELINE_CASE", GetParam()}, {"SHARDIT_STEP_CACHE_REFERENCES", references}}), 0);
    return;
  }
  shardit::dist::World::init();
  const auto references = shardit::io::SafetensorsFile::open(shardit::testing::env_or("SHARDIT_STEP_CACHE_REFERENCES"));
  StepCacheConfig skipping;
  skipping.method = shardit::models::FirstBlockCacheConfig{references->read("threshold").item<double>()};
  const bool cfg = references->read("cfg").item<int64_t>() == 1;
  const at::Tensor reference_computed = references->read("computed");
  const at::Tensor reference_latents = references->read("latents");
  const at::Tensor reference_image = references->read("image");

  int meshes = 0;
  for (const int ranks : {2, kRanks}) {
    for (const ParallelDims& mesh : ParallelDims::fitting(ranks)) {
      if (mesh.cfg > 1 && !cfg) continue;
      SCOPED_TRACE(mesh.to_string());
      const std::string what = golden.dir + " " + skipping.to_string() + " on " + mesh.to_string();
      const GenerateResult result = generate_flux2_case(golden, mesh, skipping);
      EXPECT_TRUE(at::equal(result.cache_computed, reference_computed)) << what;
      EXPECT_TRUE(shardit::testing::tensors_close(what + ": latents", result.latents, reference_latents,
                                                  shardit::testing::kPipelineAtol, shardit::testing::kPipelineRtol));
      EXPECT_TRUE(shardit::testing::tensors_close(what + ": image", result.image, reference_image,
                                                  shardit::testing::kPipelineAtol, shardit::testing::kPipelineRtol));
      ++meshes;
    }
  }
  // Without CFG: tp 2, ring 2, ulysses 2, and the six of 4 ranks.
  EXPECT_GE(meshes, 9);
  // TaylorSeer predicts the gathered output: the same under a split sequence.
  const GenerateResult taylor_split = generate_flux2_case(golden, ParallelDims{1, 2, 1, 2}, taylor);
  EXPECT_TRUE(at::equal(taylor_split.cache_computed, references->read("taylor.computed")));
  EXPECT_TRUE(shardit::testing::tensors_close("TaylorSeer on ulysses 2 x tp 2: latents", taylor_split.latents,
                                              references->read("taylor.latents"), shardit::testing::kPipelineAtol,
                                              shardit::testing::kPipelineRtol));
}

INSTANTIATE_TEST_SUITE_P(Golden, StepCacheFlux2, ::testing::Values("pipeline_flux2_klein", "pipeline_flux2_dev"),
                         [](const auto& info) { return info.param; });

// The ratio's means are over the whole sequence: on an uneven split (5 tokens on 2 ranks: 3, and
// 2 plus a padding token), averaging the two ranks' own means would give 1.5 where the sequence's
// is 1.2, and decide otherwise at threshold 1.35; padding rows (garbage here) count for nothing.
TEST(StepCacheReduction, UlyssesUnevenSplitReducesSumsNotMeansOfMeans) {
  if (!is_worker()) {
    EXPECT_EQ(run_ranks(2), 0);
    return;
  }
  auto& world = shardit::dist::World::init();
  using shardit::parallel::CpAction;
  using shardit::parallel::SequenceStream;
  const shardit::parallel::ContextParallelConfig config(world.group(), nullptr);
  shardit::parallel::ContextParallelForward cp(config, {{"hidden_states", CpAction::Split, 1, SequenceStream::Image}},
                                               "test");
  // [1, 5, 2]: r_prev all ones; r = r_prev + 3 on the last two tokens (rank 1's valid ones).
  const at::Tensor previous = at::ones({1, 5, 2});
  at::Tensor current = previous.clone();
  current.narrow(1, 3, 2).add_(3);
  const double threshold = 1.35;
  const double sequence_ratio = (current - previous).abs().mean().item<double>() / previous.abs().mean().item<double>();
  ASSERT_NEAR(sequence_ratio, 1.2, 1e-6);  // float32 means

  at::Tensor local_previous = cp.point("hidden_states", previous);  // [1, 3, 2]
  at::Tensor local_current = cp.point("hidden_states", current);
  const int64_t valid = world.rank() == 0 ? 3 : 2;
  if (valid < 3) local_current.narrow(1, valid, 3 - valid).fill_(100);  // a padding row's garbage

  shardit::models::StepCache cache(StepCacheConfig::parse("first_block_cache:threshold=1.35"));
  at::Tensor output = at::zeros_like(local_previous);
  cache.begin_forward(1, 3);
  ASSERT_TRUE(cache.head_decides(at::Tensor(), local_previous, output));
  cache.end_of_stack(output + 1);
  cache.begin_forward(1, 3);
  const at::Tensor sums = cp.sum_over_sequence("hidden_states", cache.head_residual_sums(local_current));
  // What averaging each rank's own means would give.
  at::Tensor means = at::stack({(local_current - local_previous).narrow(1, 0, valid).abs().mean(),
                                local_previous.narrow(1, 0, valid).abs().mean()})
                         .to(at::kDouble);
  world.group()->all_reduce(means);
  const double means_of_means_ratio = means[0].item<double>() / means[1].item<double>();
  EXPECT_NEAR(means_of_means_ratio, 1.5, 1e-9);
  EXPECT_GT(means_of_means_ratio, threshold);  // it would run the stack
  const bool runs = cache.head_decides(sums, local_current, output);
  EXPECT_FALSE(runs) << "the sequence's ratio is 1.2 <= " << threshold;
  EXPECT_NEAR(cache.records().at(0).ratios.at(1), 1.2, 1e-12);  // float64 sums of exact values
}

}  // namespace
}  // namespace test_step_cache_meshes
