// End-to-end parity with diffusers' FluxPipeline, Flux2KleinPipeline, Flux2Pipeline (FLUX.2 [dev])
// and QwenImagePipeline on the golden pipeline cases from the PROMPTS of case.json `call`: the
// pipelines' tokenizers and text encoders make the embeddings, then the latents after every step,
// the image and the PNG pixels are compared, through the C++ API and the CLI.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardit/pipelines/pipeline.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_parity_pipelines_prompts {
namespace {

using shardit::testing::PipelineCase;
using shardit::testing::read_prompt_case;

class PipelinePromptParity : public ::testing::TestWithParam<std::string> {};

// Two ranks: the transformer and the text encoders both at TP=2.
TEST_P(PipelinePromptParity, CliFromPromptsTp2MatchesDiffusers) {
  const PipelineCase golden = read_prompt_case(GetParam());
  const auto run = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2");
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image,
                                            GetParam() + " (CLI from prompts, TP=2)");
}

// Each component its own degree: the transformer at 2, the text encoders at 4 of 4 ranks, and
// the text encoders at 1 (--text-encoder-tp) with the transformer at 2.
TEST_P(PipelinePromptParity, CliFromPromptsOwnTextEncoderDegreeMatchesDiffusers) {
  PipelineCase golden = read_prompt_case(GetParam());
  const std::vector<std::string> base = golden.cli_args;
  golden.cli_args.insert(golden.cli_args.end(), {"--tp", "2"});
  auto run = shardit::testing::run_generate_cli(golden, "--nproc-per-node 4");
  EXPECT_NE(run.output.find("text encoders run at tensor-parallel degree 4 (transformer: 2)"), std::string::npos)
      << run.output;
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image,
                                            GetParam() + " (CLI from prompts, transformer TP=2, text TP=4)");
  golden.cli_args = base;
  golden.cli_args.insert(golden.cli_args.end(), {"--text-encoder-tp", "1"});
  run = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2");
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image,
                                            GetParam() + " (CLI from prompts, transformer TP=2, text TP=1)");
}

// FLUX.2 [dev] from prompts at TP=4 (the Mistral-3 encoder replicates its 2 key/value heads) and
// on a Ulysses-2 mesh (the transformer's sequence split; the encoder at TP=2).
TEST(PipelinePromptParityFlux2Dev, GoldenCliFromPromptsTp4AndUlysses2MatchDiffusers) {
  PipelineCase golden = read_prompt_case("pipeline_flux2_dev");
  auto run = shardit::testing::run_generate_cli(golden, "--nproc-per-node 4");
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, "flux2_dev (CLI from prompts, TP=4)");
  golden.cli_args.insert(golden.cli_args.end(), {"--ulysses", "2"});
  run = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2");
  EXPECT_NE(run.output.find("ulysses=2"), std::string::npos) << run.output;
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, "flux2_dev (CLI from prompts, ulysses 2)");
  shardit::testing::expect_pngs_match(golden, run.pngs, "flux2_dev (CLI PNG from prompts, ulysses 2)");
}

INSTANTIATE_TEST_SUITE_P(Golden, PipelinePromptParity,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_flux2_dev", "pipeline_qwenimage"),
                         [](const auto& info) { return info.param.substr(9); });

}  // namespace
}  // namespace test_parity_pipelines_prompts
