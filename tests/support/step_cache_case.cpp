// The golden step-cache cases and their comparison (step_cache_case.h).
#include "support/step_cache_case.h"

#include <cmath>

#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "support/test_support.h"

namespace shardit::testing {

CacheGolden read_cache_golden(const std::string& name) {
  CacheGolden golden;
  golden.dir = golden_path(name);
  const nlohmann::json document = io::read_json_file(golden.dir + "/case.json");
  golden.cases = document.at("cases");
  golden.pipeline = read_prompt_case(name == "cache_flux1" ? "pipeline_flux1" : "pipeline_qwenimage");
  set_case_steps(golden.pipeline, document.at("call").at("num_inference_steps").get<int64_t>());
  EXPECT_EQ(golden.pipeline.steps, kCacheSteps);
  return golden;
}

void expect_cache_case_matches(const CacheGolden& golden, const nlohmann::json& golden_case,
                               const std::vector<std::string>& contexts, const at::Tensor& computed,
                               const at::Tensor& ratio, const at::Tensor& image, const std::string& what) {
  const std::string name = golden_case.at("name").get<std::string>();
  ASSERT_TRUE(computed.defined()) << what << ": no cache decisions were reported";
  ASSERT_EQ(computed.dim(), 2) << what;
  ASSERT_EQ(computed.size(1), static_cast<int64_t>(contexts.size())) << what;
  const auto per_step = golden_case.at("full_stack_calls_per_step").get<std::vector<int64_t>>();
  ASSERT_EQ(computed.size(0), static_cast<int64_t>(per_step.size())) << what;
  for (size_t s = 0; s < per_step.size(); ++s) {
    EXPECT_EQ(computed[static_cast<int64_t>(s)].sum().item<int64_t>(), per_step[s]) << what << ": step " << s;
  }
  if (golden_case.contains("decisions")) {
    ASSERT_TRUE(ratio.defined()) << what;
    for (size_t c = 0; c < contexts.size(); ++c) {
      int64_t step = 0;
      for (const nlohmann::json& decision : golden_case.at("decisions")) {
        if (decision.at("context") != contexts[c]) continue;
        const auto at_step = [&](const at::Tensor& t) { return t[step][static_cast<int64_t>(c)]; };
        EXPECT_EQ(at_step(computed).item<int64_t>() == 1, decision.at("compute").get<bool>())
            << what << ": " << contexts[c] << " step " << step;
        const double ours = at_step(ratio).item<double>();
        if (decision.at("ratio").is_null()) {
          EXPECT_TRUE(std::isnan(ours)) << what << ": " << contexts[c] << " step " << step << " ratio " << ours;
        } else {
          // diffusers' float32 means against float64 sums: far inside the >= 2% margins.
          EXPECT_NEAR(ours, decision.at("ratio").get<double>(), 1e-4 * decision.at("ratio").get<double>())
              << what << ": " << contexts[c] << " step " << step;
        }
        ++step;
      }
      EXPECT_EQ(step, kCacheSteps) << what << ": golden decisions of " << contexts[c];
    }
  }
  if (image.defined()) {
    const auto outputs = io::SafetensorsFile::open(golden.dir + "/outputs.safetensors");
    EXPECT_TRUE(tensors_close(what + ": " + name + ".image", image, outputs->read(name + ".image"), kPipelineAtol,
                              kPipelineRtol));
  }
}

std::vector<std::string> golden_contexts(const CacheGolden& golden) {
  return golden.pipeline.request.negative_prompt.empty() ? std::vector<std::string>{"cond"}
                                                         : std::vector<std::string>{"cond", "uncond"};
}

}  // namespace shardit::testing
