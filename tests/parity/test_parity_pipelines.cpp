// End-to-end parity with diffusers' FluxPipeline, Flux2KleinPipeline, Flux2Pipeline (FLUX.2 [dev])
// and QwenImagePipeline on the golden pipeline cases, single rank: from the stored prompt
// embeddings and latents, the latents after every step, the image and the PNG pixels, through the
// C++ API and the CLI.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "shardit/pipelines/pipeline.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_parity_pipelines {
namespace {

using shardit::testing::PipelineCase;

class PipelineParity : public ::testing::TestWithParam<std::string> {};

TEST_P(PipelineParity, ApiMatchesDiffusers) {
  PipelineCase golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path(GetParam()));
  shardit::testing::expect_api_matches(golden, GetParam() + " (API, TP=1)");
}

TEST_P(PipelineParity, CliMatchesDiffusers) {
  const PipelineCase golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path(GetParam()));
  const auto run = shardit::testing::run_generate_cli(golden, "");
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, GetParam() + " (CLI, TP=1)");
  EXPECT_TRUE(at::equal(run.latents, run.step_latents.back()));
  shardit::testing::expect_pngs_match(golden, run.pngs, GetParam() + " (CLI PNG)");
}

// case.json's latents_seed: the pipeline's own draw from torch.Generator("cpu").manual_seed(seed)
// gave the stored latents, so drawing from the seed must give the stored image.
TEST_P(PipelineParity, SeedGivesDiffusersImage) {
  PipelineCase golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path(GetParam()));
  const auto case_json = shardit::io::read_json_file(golden.dir + "/case.json");
  golden.request.latents.reset();
  golden.request.seed = case_json.at("latents_seed").get<uint64_t>();
  shardit::testing::expect_api_matches(golden, GetParam() + " (seeded)");
}

INSTANTIATE_TEST_SUITE_P(Golden, PipelineParity,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_flux2_dev", "pipeline_qwenimage"),
                         [](const auto& info) { return info.param.substr(9); });

}  // namespace
}  // namespace test_parity_pipelines
