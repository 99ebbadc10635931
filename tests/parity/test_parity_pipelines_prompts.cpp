// End-to-end parity with diffusers' FluxPipeline, Flux2KleinPipeline and QwenImagePipeline on
// the golden pipeline cases from the PROMPTS of case.json `call`: the pipelines' tokenizers and
// text encoders make the embeddings, then the latents after every step, the image and the PNG
// pixels are compared, through the C++ API and the CLI.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/pipelines/pipeline.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace {

using shardit::testing::PipelineCase;
using shardit::testing::read_prompt_case;

class PipelinePromptParity : public ::testing::TestWithParam<std::string> {};

TEST_P(PipelinePromptParity, ApiFromPromptsMatchesDiffusers) {
  PipelineCase golden = read_prompt_case(GetParam());
  shardit::testing::expect_api_matches(golden, GetParam() + " (API from prompts, TP=1)");
}

TEST_P(PipelinePromptParity, CliFromPromptsMatchesDiffusers) {
  const PipelineCase golden = read_prompt_case(GetParam());
  const auto run = shardit::testing::run_generate_cli(golden, "");
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image,
                                            GetParam() + " (CLI from prompts, TP=1)");
  shardit::testing::expect_pngs_match(golden, run.pngs, GetParam() + " (CLI PNG from prompts)");
}

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

// Without its text encoders a pipeline cannot take text prompts: a clear error before any compute.
TEST(PipelinePromptErrors, GoldenPromptWithoutTextEncodersIsNamed) {
  PipelineCase golden = read_prompt_case("pipeline_flux1");
  shardit::pipelines::PipelineLoadOptions options;
  options.load_text_encoders = false;
  const auto pipeline = shardit::pipelines::DiffusionPipeline::open(golden.dir, options);
  try {
    pipeline->check(golden.request);
    FAIL() << "a text prompt without text encoders was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("no text encoder"), std::string::npos)
        << e.what_without_backtrace();
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, PipelinePromptParity,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_qwenimage"),
                         [](const auto& info) { return info.param.substr(9); });

}  // namespace
