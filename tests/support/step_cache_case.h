#pragma once
// The golden step-cache cases (cache_flux1, cache_qwenimage: diffusers' enable_cache on the golden
// pipelines, from their prompts, 10 steps) and the comparison of a run's per-step decisions,
// ratios and image with what diffusers' hooks recorded.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "support/pipeline_case.h"

namespace shardit::testing {

/// The golden cache cases' num_inference_steps.
constexpr int64_t kCacheSteps = 10;

/// A golden cache folder and the pipeline case it was made on (its prompts, latents, 10 steps).
struct CacheGolden {
  std::string dir;
  PipelineCase pipeline;
  nlohmann::json cases;
};

/// Reads the golden cache folder `name` (cache_flux1 or cache_qwenimage).
CacheGolden read_cache_golden(const std::string& name);

/// The contexts the case's pipeline runs: "cond", and "uncond" with a negative prompt.
std::vector<std::string> golden_contexts(const CacheGolden& golden);

/// Compares one run of a golden cache case: per step, how many contexts ran the whole stack;
/// for First-Block Cache every decision and ratio per context; the image (when defined).
void expect_cache_case_matches(const CacheGolden& golden, const nlohmann::json& golden_case,
                               const std::vector<std::string>& contexts, const at::Tensor& computed,
                               const at::Tensor& ratio, const at::Tensor& image, const std::string& what);

}  // namespace shardit::testing
