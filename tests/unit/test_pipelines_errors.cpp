// Bad requests and folders are refused with a message naming the problem, before any compute:
// sizes, steps, missing components, prompt embeddings of the wrong width or dtype, latents of
// the wrong shape, outputs that cannot be written. On the built-in tiny pipeline (no golden data).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "shardit/io/json.h"
#include "shardit/io/png.h"
#include "shardit/models/builtin.h"
#include "shardit/pipelines/pipeline.h"
#include "support/test_support.h"

namespace test_pipelines_errors {
namespace {

namespace fs = std::filesystem;
using shardit::pipelines::DiffusionPipeline;
using shardit::pipelines::GenerateRequest;
using shardit::testing::error_of;
using ::testing::HasSubstr;

const shardit::models::BuiltinModelPaths& builtin() {
  static const auto paths = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  return paths;
}

DiffusionPipeline& pipeline() {
  static const auto loaded = [] {
    shardit::pipelines::PipelineLoadOptions options;
    options.load_vae = true;
    // Prompt embeddings only: the requests below carry them, and prompts must ask for them.
    options.load_text_encoders = false;
    return DiffusionPipeline::from_pretrained(builtin().pipeline, options);
  }();
  return *loaded;
}

// The width of a packed latent token: the transformer's in_channels (the VAE's latent channels x
// the 2x2 patch), read from the built-in folder so the test follows its weights.
int64_t packed_channels() {
  return shardit::io::read_json_file(builtin().pipeline + "/transformer/config.json").at("in_channels").get<int64_t>();
}

GenerateRequest small_request() {
  GenerateRequest request;
  request.prompt_embeds = shardit::pipelines::read_prompt_embeds(builtin().prompt_embeds);
  request.height = 32;
  request.width = 48;
  request.num_inference_steps = 2;
  request.notes = false;
  return request;
}

TEST(PipelineErrors, StepsMustBePositive) {
  GenerateRequest request = small_request();
  request.num_inference_steps = 0;
  EXPECT_THAT(error_of([&] { pipeline().generate(request); }), HasSubstr("num_inference_steps (--steps) is 0"));
}

TEST(PipelineErrors, SizeTooSmallIsRefusedAndOddSizesAreRounded) {
  GenerateRequest request = small_request();
  request.height = 8;
  EXPECT_THAT(error_of([&] { pipeline().generate(request); }), HasSubstr("at least 16 pixels"));
  request.height = 40;  // -> 32
  request.width = 50;   // -> 48
  const auto result = pipeline().generate(request);
  EXPECT_EQ(result.height, 32);
  EXPECT_EQ(result.width, 48);
  EXPECT_EQ(result.image.sizes(), (std::vector<int64_t>{1, 32, 48, 3}));
  EXPECT_EQ(result.latents.sizes(), (std::vector<int64_t>{1, 6, packed_channels()}));
}

TEST(PipelineErrors, PromptEmbeddingsOfTheWrongWidthOrDtype) {
  GenerateRequest request = small_request();
  request.prompt_embeds->prompt_embeds = at::zeros({1, 8, 16});
  EXPECT_THAT(
      error_of([&] { pipeline().generate(request); }),
      HasSubstr("prompt_embeds has width 16 (shape [1, 8, 16]), but the transformer's joint_attention_dim is 64"));
  request.prompt_embeds->prompt_embeds = at::zeros({1, 8, 64}, at::kLong);
  EXPECT_THAT(error_of([&] { pipeline().generate(request); }), HasSubstr("prompt_embeds has dtype Long"));
  request = small_request();
  request.prompt_embeds->pooled_prompt_embeds.reset();
  EXPECT_THAT(error_of([&] { pipeline().generate(request); }), HasSubstr("pooled_prompt_embeds [1, 96] is missing"));
}

TEST(PipelineErrors, LatentsOfTheWrongShape) {
  GenerateRequest request = small_request();
  request.latents = at::zeros({1, 6, 8});
  EXPECT_THAT(error_of([&] { pipeline().generate(request); }),
              HasSubstr("latents have shape [1, 6, 8], expected [1, 6, " + std::to_string(packed_channels()) + "]"));
}

TEST(PipelineErrors, PromptsWithoutAnEncoderAskForEmbeddings) {
  GenerateRequest request = small_request();
  request.prompt_embeds.reset();
  request.prompt = {"a cat"};
  EXPECT_THAT(error_of([&] { pipeline().generate(request); }), HasSubstr("pass prompt embeddings"));
}

TEST(PipelineErrors, MissingComponentIsNamed) {
  const std::string dir = shardit::testing::make_temp_dir("pipeline-missing");
  fs::copy(builtin().pipeline, dir + "/model", fs::copy_options::recursive);
  auto index = shardit::io::read_json_file(dir + "/model/model_index.json");
  index.erase("vae");
  std::ofstream(dir + "/model/model_index.json") << index.dump();
  EXPECT_THAT(error_of([&] { DiffusionPipeline::from_pretrained(dir + "/model"); }),
              HasSubstr("the pipeline has no 'vae' component"));
}

TEST(PipelineErrors, SameSeedSameImageOtherSeedOtherImage) {
  GenerateRequest request = small_request();
  request.seed = 1;
  const at::Tensor a = pipeline().generate(request).image;
  const at::Tensor b = pipeline().generate(request).image;
  request.seed = 2;
  const at::Tensor c = pipeline().generate(request).image;
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, c));
}

TEST(PipelineErrors, PngRoundTripWithParameters) {
  const std::string dir = shardit::testing::make_temp_dir("png");
  const at::Tensor image = at::rand({5, 7, 3});
  shardit::io::write_png(dir + "/a.png", shardit::io::to_uint8_pixels(image), {{"prompt", "一个女孩"}, {"seed", "42"}});
  EXPECT_TRUE(at::equal(shardit::io::read_png(dir + "/a.png"), shardit::io::to_uint8_pixels(image)));
  std::ifstream in(dir + "/a.png", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(bytes.find(std::string("tEXtseed\0"
                                   "42",
                                   11)),
            std::string::npos);
  EXPECT_NE(bytes.find("iTXtprompt"), std::string::npos);
  EXPECT_EQ(shardit::io::image_paths("x/out.png", 2), (std::vector<std::string>{"x/out_0.png", "x/out_1.png"}));
}

TEST(PipelineErrors, CliRefusesAnUnwritableOutputBeforeLoading) {
  std::string output;
  const std::string command = shardit::testing::cli_path() + " generate --model " + builtin().pipeline +
                              " --prompt-embeds " + builtin().prompt_embeds + " --out /nonexistent-folder/x.png";
  EXPECT_NE(shardit::testing::run_command(command, &output), 0);
  EXPECT_THAT(output, HasSubstr("/nonexistent-folder/x.png"));
  const std::string steps = shardit::testing::cli_path() + " generate --model " + builtin().pipeline + " --steps 0";
  EXPECT_NE(shardit::testing::run_command(steps, &output), 0);
  EXPECT_THAT(output, HasSubstr("--steps"));
}

}  // namespace
}  // namespace test_pipelines_errors
