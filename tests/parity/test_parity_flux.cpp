// FLUX.1 specifics against diffusers' golden data: the timestep frequency table, id layouts,
// guidance errors, and the CLI. The sample and every intermediate of each golden case are
// compared in test_parity_transformers.cpp. fp32 tolerance 1e-4 + 1e-4|b|.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/registry.h"
#include "shardit/nn/timestep_embeddings.h"
#include "shardit/verify/transformer_case.h"
#include "support/test_support.h"

namespace shardit {
namespace test_parity_flux {
namespace {

using models::FluxTransformer2DModel;
using models::FluxTransformer2DModelInputs;
using testing::golden_path;
using testing::tensors_close;

constexpr double kTol = 1e-4;

/// Builds the model named by the case's config and loads it through the real load path.
std::shared_ptr<FluxTransformer2DModel> load_case_model(const std::string& case_dir,
                                                        const parallel::LoadOptions& options = {}) {
  const io::ComponentFolder folder = io::ModelFolder::open(case_dir).component("");
  std::shared_ptr<parallel::TensorParallelModule> model = models::create_transformer(folder);
  auto flux = std::dynamic_pointer_cast<FluxTransformer2DModel>(model);
  EXPECT_TRUE(flux) << case_dir << ": create_transformer did not build a FluxTransformer2DModel";
  if (flux) flux->load(folder.weights(), options);
  return flux;
}

TEST(FluxParityPieces, TimestepFrequenciesMatchTheReferenceTable) {
  // The sinusoid's argument reaches thousands of radians, so the fp32 table must be bit-exact.
  const auto table = io::SafetensorsFile::open(golden_path("common/timestep_freqs.safetensors"));
  const at::Tensor freqs = nn::timestep_frequencies(256, 0.0);
  EXPECT_TRUE(at::equal(freqs, table->read("freqs")))
      << "max diff " << (freqs - table->read("freqs")).abs().max().item<double>();
}

TEST(FluxParityPieces, BatchedIdsUseTheFirstEntry) {
  const std::string dir = golden_path("flux_b2_nonsquare");
  auto model = load_case_model(dir);
  ASSERT_TRUE(model);
  const auto inputs_file = io::SafetensorsFile::open(dir + "/inputs.safetensors");
  FluxTransformer2DModelInputs inputs = FluxTransformer2DModelInputs::from_file(*inputs_file);
  const at::Tensor expected = io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample");
  const int64_t batch = inputs.hidden_states.size(0);
  inputs.img_ids = inputs.img_ids.unsqueeze(0).expand({batch, -1, -1});
  inputs.txt_ids = inputs.txt_ids.unsqueeze(0).expand({batch, -1, -1});
  EXPECT_TRUE(tensors_close("sample with [B, S, 3] ids", model->forward(inputs), expected, kTol, kTol));
}

TEST(FluxParityPieces, GuidanceMismatchIsReported) {
  auto model = load_case_model(golden_path("flux_b1_square"));
  ASSERT_TRUE(model);
  const auto inputs_file = io::SafetensorsFile::open(golden_path("flux_b1_square/inputs.safetensors"));
  FluxTransformer2DModelInputs inputs = FluxTransformer2DModelInputs::from_file(*inputs_file);
  inputs.guidance.reset();
  EXPECT_EQ(testing::error_of([&] { model->forward(inputs); }),
            "FluxTransformer2DModel: this model embeds guidance (guidance_embeds=true); pass `guidance` [B]");
}

TEST(TransformerRegistry, UnknownClassListsTheSupportedOnes) {
  io::ComponentFolder folder;
  folder.dir = "some/transformer";
  folder.name = "transformer";
  folder.config = nlohmann::json{{"_class_name", "NoSuchTransformer"}};
  try {
    models::create_transformer(folder);
    ADD_FAILURE() << "create_transformer accepted an unknown class";
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("NoSuchTransformer"), std::string::npos) << message;
    EXPECT_NE(message.find("FluxTransformer2DModel"), std::string::npos) << message;
    EXPECT_NE(message.find("some/transformer/config.json"), std::string::npos) << message;
  }
}

TEST(FluxCli, RunTransformerWritesTheGoldenSample) {
  const std::string dir = golden_path("flux_b1_square");
  const std::string out = testing::make_temp_dir("flux-cli") + "/sample.safetensors";
  std::string output;
  const int status = testing::run_command(
      testing::cli_path() + " run-transformer --model " + dir + " --inputs " + dir + " --out " + out, &output);
  ASSERT_EQ(status, 0) << output;
  const at::Tensor got = io::SafetensorsFile::open(out)->read("sample");
  const at::Tensor expected = io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample");
  EXPECT_TRUE(tensors_close("CLI sample", got, expected, kTol, kTol));
}

TEST(FluxCli, UnknownDtypeFailsWithAMessage) {
  const std::string dir = golden_path("flux_b1_square");
  std::string output;
  const int status = testing::run_command(testing::cli_path() + " run-transformer --model " + dir + " --inputs " +
                                              dir + " --out /dev/null --dtype f8",
                                          &output);
  EXPECT_NE(status, 0) << output;
  EXPECT_NE(output.find("dtype 'f8' is not supported; use f32 or bf16\n"), std::string::npos) << output;
}

}  // namespace
}  // namespace test_parity_flux
}  // namespace shardit
