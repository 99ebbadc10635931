// The one-rank cases of the end-to-end parity from prompts (test_parity_pipelines_prompts.cpp
// holds those that start ranks): the API and the CLI at TP=1 against diffusers' pipelines, and the
// errors a prompt meets before any compute. No case here starts ranks, so this file's entry runs
// beside the rank groups.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/pipelines/pipeline.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_parity_pipelines_prompts_one_rank {
namespace {

using shardit::testing::PipelineCase;
using shardit::testing::read_prompt_case;

class PipelinePromptParityOneRank : public ::testing::TestWithParam<std::string> {};

TEST_P(PipelinePromptParityOneRank, ApiFromPromptsMatchesDiffusers) {
  PipelineCase golden = read_prompt_case(GetParam());
  shardit::testing::expect_api_matches(golden, GetParam() + " (API from prompts, TP=1)");
}

TEST_P(PipelinePromptParityOneRank, CliFromPromptsMatchesDiffusers) {
  const PipelineCase golden = read_prompt_case(GetParam());
  const auto run = shardit::testing::run_generate_cli(golden, "");
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image,
                                            GetParam() + " (CLI from prompts, TP=1)");
  shardit::testing::expect_pngs_match(golden, run.pngs, GetParam() + " (CLI PNG from prompts)");
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

// Over 512 tokens: truncated to the first 512 with a note, as diffusers' processor call does;
// the empty prompt is a prompt like any other (the template alone).
TEST(PipelinePromptOneRankFlux2Dev, GoldenLongPromptIsTruncatedWithANoteAndEmptyPromptRuns) {
  PipelineCase golden = read_prompt_case("pipeline_flux2_dev");
  std::string long_prompt;
  for (int i = 0; i < 300; ++i) long_prompt += "a cat ";
  for (size_t i = 0; i < golden.cli_args.size(); ++i) {
    if (golden.cli_args[i] == "--prompt") golden.cli_args[i + 1] = long_prompt;
  }
  const auto run = shardit::testing::run_generate_cli(golden, "");
  EXPECT_NE(run.output.find("more than max_length 512"), std::string::npos) << run.output;
  EXPECT_EQ(run.image.sizes(), (std::vector<int64_t>{1, 48, 64, 3}));

  golden.request.prompt = {""};
  golden.request.callback_on_step_end = nullptr;
  shardit::pipelines::PipelineLoadOptions options;
  options.load_vae = true;
  const auto result = shardit::pipelines::DiffusionPipeline::from_pretrained(golden.dir, options)->generate(golden.request);
  EXPECT_TRUE(result.image.defined());
  EXPECT_TRUE(at::isfinite(result.image).all().item<bool>());
}

// A Flux2Pipeline folder whose text_encoder is another registered class is refused by name before
// any weight is read (its weights here are not even a safetensors file); one without a
// text_encoder refuses text prompts before loading.
TEST(PipelinePromptErrors, GoldenFlux2DevTextEncoderMissingOrOfAnotherClassIsNamed) {
  namespace fs = std::filesystem;
  const PipelineCase golden = read_prompt_case("pipeline_flux2_dev");
  const std::string dir = shardit::testing::make_temp_dir("flux2-dev-encoder") + "/model";
  fs::copy(golden.dir, dir, fs::copy_options::recursive);
  fs::permissions(dir, fs::perms::owner_all, fs::perm_options::add);
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    fs::permissions(entry.path(), fs::perms::owner_read | fs::perms::owner_write, fs::perm_options::add);
    if (entry.is_directory()) fs::permissions(entry.path(), fs::perms::owner_exec, fs::perm_options::add);
  }
  fs::copy_file(shardit::testing::golden_path("text/qwen3_klein/config.json"), dir + "/text_encoder/config.json",
                fs::copy_options::overwrite_existing);
  std::ofstream(dir + "/text_encoder/model.safetensors", std::ios::trunc) << "not weights";
  const std::string message = shardit::testing::error_of(
      [&] { shardit::pipelines::DiffusionPipeline::from_pretrained(dir, shardit::pipelines::PipelineLoadOptions{}); });
  EXPECT_NE(message.find("text_encoder/config.json: a Flux2Pipeline encodes prompts with a "
                         "Mistral3ForConditionalGeneration as its text_encoder, got 'Qwen3ForCausalLM'"),
            std::string::npos)
      << message;

  fs::remove_all(dir + "/text_encoder");
  nlohmann::json index = shardit::io::read_json_file(dir + "/model_index.json");
  index.erase("text_encoder");
  std::ofstream(dir + "/model_index.json", std::ios::trunc) << index.dump();
  const auto pipeline = shardit::pipelines::DiffusionPipeline::open(dir, shardit::pipelines::PipelineLoadOptions{});
  const std::string missing = shardit::testing::error_of([&] { pipeline->check(golden.request); });
  EXPECT_NE(missing.find("has no text encoder"), std::string::npos) << missing;

  // Flux2Pipeline has no negative prompt: refused before anything loads.
  const auto dev = shardit::pipelines::DiffusionPipeline::open(golden.dir, shardit::pipelines::PipelineLoadOptions{});
  shardit::pipelines::GenerateRequest negative = golden.request;
  negative.negative_prompt = {"blurry"};
  const std::string refused = shardit::testing::error_of([&] { dev->check(negative); });
  EXPECT_NE(refused.find("Flux2Pipeline takes no negative prompt"), std::string::npos) << refused;
}

INSTANTIATE_TEST_SUITE_P(Golden, PipelinePromptParityOneRank,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_flux2_dev", "pipeline_qwenimage"),
                         [](const auto& info) { return info.param.substr(9); });

}  // namespace
}  // namespace test_parity_pipelines_prompts_one_rank
