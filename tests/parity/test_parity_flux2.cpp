// FLUX.2 specifics against diffusers' golden data: id layouts, guidance errors, and the CLI. The
// sample and every intermediate of each golden case (incl. the fused to_qkv_mlp_proj) are
// compared in test_parity_transformers.cpp. fp32 tolerance 1e-4 + 1e-4|b|.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/flux2/transformer_flux2.h"
#include "shardit/models/registry.h"
#include "shardit/verify/transformer_case.h"
#include "support/test_support.h"

namespace shardit {
namespace test_parity_flux2 {
namespace {

using models::Flux2Transformer2DModel;
using models::Flux2Transformer2DModelInputs;
using testing::golden_path;
using testing::tensors_close;

constexpr double kTol = 1e-4;

/// Builds the model named by the case's config and loads it through the real load path.
std::shared_ptr<Flux2Transformer2DModel> load_case_model(const std::string& case_dir) {
  const io::ComponentFolder folder = io::ModelFolder::open(case_dir).component("");
  std::shared_ptr<parallel::TensorParallelModule> model = models::create_transformer(folder);
  auto flux2 = std::dynamic_pointer_cast<Flux2Transformer2DModel>(model);
  EXPECT_TRUE(flux2) << case_dir << ": create_transformer did not build a Flux2Transformer2DModel";
  if (flux2) flux2->load(folder.weights(), {});
  return flux2;
}

Flux2Transformer2DModelInputs read_inputs(const std::string& case_dir) {
  const auto file = io::SafetensorsFile::open(case_dir + "/inputs.safetensors");
  return Flux2Transformer2DModelInputs::from_file(*file);
}

TEST(Flux2ParityPieces, TwoDimensionalIdsGiveTheSameSample) {
  // The model uses ids[0]; passing [S, 4] directly must not change anything.
  const std::string dir = golden_path("flux2_b2_nonsquare");
  auto model = load_case_model(dir);
  ASSERT_TRUE(model);
  Flux2Transformer2DModelInputs inputs = read_inputs(dir);
  inputs.img_ids = inputs.img_ids.select(0, 0);
  inputs.txt_ids = inputs.txt_ids.select(0, 0);
  const at::Tensor expected = io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample");
  EXPECT_TRUE(tensors_close("sample with [S, 4] ids", model->forward(inputs), expected, kTol, kTol));
}

TEST(Flux2ParityPieces, GuidanceMismatchIsReported) {
  {
    auto model = load_case_model(golden_path("flux2_b1_square"));
    ASSERT_TRUE(model);
    Flux2Transformer2DModelInputs inputs = read_inputs(golden_path("flux2_b1_square"));
    inputs.guidance.reset();
    EXPECT_EQ(testing::error_of([&] { model->forward(inputs); }),
              "Flux2Transformer2DModel: this model embeds guidance (guidance_embeds=true); pass `guidance` [B]");
  }
  {
    auto model = load_case_model(golden_path("flux2_klein_b2_nonsquare"));
    ASSERT_TRUE(model);
    Flux2Transformer2DModelInputs inputs = read_inputs(golden_path("flux2_klein_b2_nonsquare"));
    inputs.guidance = at::ones({inputs.hidden_states.size(0)});
    EXPECT_EQ(testing::error_of([&] { model->forward(inputs); }),
              "Flux2Transformer2DModel: this model has no guidance embedder (guidance_embeds=false); pass no "
              "`guidance`");
  }
}

TEST(Flux2ParityPieces, WrongIdColumnsAreReported) {
  auto model = load_case_model(golden_path("flux2_b1_square"));
  ASSERT_TRUE(model);
  Flux2Transformer2DModelInputs inputs = read_inputs(golden_path("flux2_b1_square"));
  inputs.img_ids = inputs.img_ids.slice(-1, 0, 3);
  std::ostringstream expected;
  const int64_t tokens = inputs.hidden_states.size(1);
  const size_t axes = model->config.axes_dims_rope.size();
  expected << "Flux2Transformer2DModel: img_ids must be [B, S=" << tokens << ", " << axes << "] or [S=" << tokens
           << ", " << axes << "], got " << inputs.img_ids.sizes();
  EXPECT_EQ(testing::error_of([&] { model->forward(inputs); }), expected.str());
}

TEST(Flux2Cli, RunTransformerWritesTheGoldenSample) {
  for (const std::string name : {"flux2_b2_nonsquare", "flux2_klein_b2_nonsquare"}) {
    const std::string dir = golden_path(name);
    const std::string out = testing::make_temp_dir("flux2-cli") + "/sample.safetensors";
    std::string output;
    const int status = testing::run_command(
        testing::cli_path() + " run-transformer --model " + dir + " --inputs " + dir + " --out " + out, &output);
    ASSERT_EQ(status, 0) << output;
    EXPECT_NE(output.find("Flux2Transformer2DModel"), std::string::npos) << output;
    const at::Tensor got = io::SafetensorsFile::open(out)->read("sample");
    const at::Tensor expected = io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample");
    EXPECT_TRUE(tensors_close(name + " CLI sample", got, expected, kTol, kTol));
  }
}

}  // namespace
}  // namespace test_parity_flux2
}  // namespace shardit
