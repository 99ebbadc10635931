// The memory planner on the real configs (tests/fixtures/configs, config.json only): parameter
// counts against the released models, per-rank counts under both plans at TP=8, the activation
// estimate's structure, and `shardit inspect --plan` on folders without weights, with the same
// errors as with weights.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "shardit/core/error.h"
#include "shardit/io/model_folder.h"
#include "shardit/models/memory_plan.h"
#include "shardit/models/registry.h"
#include "support/test_support.h"

namespace test_memory_plan {
namespace {

namespace fs = std::filesystem;
using shardit::models::ComponentMemory;
using shardit::parallel::TpPlanKind;
using shardit::testing::error_of;
using ::testing::HasSubstr;

std::string fixture(const std::string& name) {
  return std::string(SHARDIT_SOURCE_DIR) + "/tests/fixtures/configs/" + name;
}

std::shared_ptr<shardit::parallel::TensorParallelModule> create(const std::string& dir) {
  return shardit::models::create_transformer(shardit::io::open_component(dir, "transformer"));
}

ComponentMemory memory(const std::string& name, int tp, TpPlanKind kind) {
  return shardit::models::memory_of(create(fixture(name))->resolve(tp, at::kBFloat16, kind));
}

struct RealModel {
  const char* fixture;
  double parameters;             ///< the released model's count (diffusers' module)
  double reference_replicated;   ///< what the reference plan leaves whole on every rank
  double reference_per_rank_tp8; ///< 0: not stated
};

// Counts of diffusers' modules built from the same configs (FLUX.1-dev 11.90B, FLUX.2-dev
// 32.22B, Qwen-Image 20.43B; the reference plans leave 3.29B, 0.82B and 6.84B whole), to the
// stated precision.
const RealModel kRealModels[] = {
    {"flux1_dev", 11.90e9, 3.29e9, 4.4e9},
    {"flux2_dev", 32.22e9, 0.82e9, 0},
    {"qwen_image", 20.43e9, 6.84e9, 8.5e9},
    // Qwen-Image-Edit-2511's transformer: Qwen-Image's with zero_cond_t, which adds no parameter.
    {"qwen_image_edit_2511/transformer", 20.43e9, 6.84e9, 8.5e9},
};

TEST(MemoryPlan, RealConfigsMatchTheReleasedParameterCounts) {
  for (const auto& model : kRealModels) {
    SCOPED_TRACE(model.fixture);
    const ComponentMemory reference = memory(model.fixture, 8, TpPlanKind::Reference);
    EXPECT_NEAR(static_cast<double>(reference.parameters_total), model.parameters, 0.006e9);
    EXPECT_NEAR(static_cast<double>(reference.parameters_replicated), model.reference_replicated, 0.006e9);
    // The reference plan's own arithmetic: replicated whole, sharded split 8 ways.
    EXPECT_EQ(reference.per_rank_parameters, reference.parameters_replicated + reference.parameters_sharded / 8);
    if (model.reference_per_rank_tp8 > 0) {
      EXPECT_NEAR(static_cast<double>(reference.per_rank_parameters), model.reference_per_rank_tp8, 0.05e9);
    }
    EXPECT_EQ(reference.plan, "reference");
  }
}

// Qwen-Image's VAE (Qwen-Image-Edit-2511's vae/ config) with its encoder, as the editing
// pipelines load it: 126,892,531 parameters counted from diffusers' AutoencoderKLQwenImage built
// from this config (encoder 53,595,872 + quant_conv 1,056 + post_quant_conv 272 + decoder
// 73,295,331), replicated on every rank at any degree.
constexpr int64_t kQwenImageVaeParameters = 126892531;

TEST(MemoryPlan, QwenImageVaeCountsEncoderAndDecoder) {
  const auto vae = shardit::models::create_vae(shardit::io::open_component(fixture("qwen_image_edit_2511"), "vae"));
  ASSERT_TRUE(vae->has_encoder());
  // The VAE's plan is empty (the planner's "replicated"): everything whole on each of 8 ranks.
  const ComponentMemory counted = shardit::models::memory_of(vae->resolve(8, at::kBFloat16, TpPlanKind::Full));
  EXPECT_EQ(counted.parameters_total, kQwenImageVaeParameters);
  EXPECT_EQ(counted.parameters_replicated, kQwenImageVaeParameters);
  EXPECT_EQ(counted.per_rank_parameters, kQwenImageVaeParameters);
  EXPECT_EQ(counted.per_rank_bytes, kQwenImageVaeParameters * 2);
}

TEST(MemoryPlan, FullPlanAtTp8IsAnEighthPlusTheUnshardableRemainder) {
  for (const auto& model : kRealModels) {
    SCOPED_TRACE(model.fixture);
    const ComponentMemory full = memory(model.fixture, 8, TpPlanKind::Full);
    const ComponentMemory reference = memory(model.fixture, 8, TpPlanKind::Reference);
    EXPECT_EQ(full.parameters_total, reference.parameters_total);
    // What stays whole under the full plan is the genuinely unshardable part: embedders,
    // norm_out / proj_out and the per-head norms, under 2% of the model.
    EXPECT_LT(static_cast<double>(full.parameters_replicated), 0.02 * static_cast<double>(full.parameters_total));
    const double target = static_cast<double>(full.parameters_total) / 8 + static_cast<double>(full.parameters_replicated);
    EXPECT_LE(static_cast<double>(full.per_rank_parameters), 1.05 * target);
    EXPECT_GE(static_cast<double>(full.per_rank_parameters), 0.95 * static_cast<double>(full.parameters_total) / 8);
    EXPECT_LT(full.per_rank_bytes, reference.per_rank_bytes);
    // bf16: two bytes per parameter, buffers aside.
    EXPECT_NEAR(static_cast<double>(full.per_rank_bytes), 2.0 * static_cast<double>(full.per_rank_parameters),
                0.01 * static_cast<double>(full.per_rank_bytes));
  }
}

TEST(MemoryPlan, KleinHasParametersAndBothPlansResolve) {
  const ComponentMemory full = memory("flux2_klein_4b", 4, TpPlanKind::Full);
  const ComponentMemory reference = memory("flux2_klein_4b", 4, TpPlanKind::Reference);
  EXPECT_GT(full.parameters_total, int64_t{3'500'000'000});
  EXPECT_LT(full.parameters_total, int64_t{4'500'000'000});
  EXPECT_LT(full.per_rank_parameters, reference.per_rank_parameters);
}

TEST(MemoryPlan, TpDegreeThatCannotDivideIsTheResolversError) {
  // 24 heads: 5 does not divide; the message names the heads and the degrees that work.
  const std::string message = error_of([] { memory("flux1_dev", 5, TpPlanKind::Reference); });
  EXPECT_THAT(message, HasSubstr("num_attention_heads"));
  EXPECT_THAT(message, HasSubstr("24"));
}

TEST(MemoryPlan, ActivationEstimateScalesWithTokensAndDegree) {
  auto model = create(fixture("flux1_dev"));
  shardit::models::StepShape small;
  small.height = small.width = 512;
  shardit::models::StepShape large = small;
  large.height = large.width = 1024;
  const auto bytes = [&](const shardit::models::StepShape& shape, int tp) {
    return shardit::models::transformer_step_activation_bytes(*model, tp, at::kBFloat16, shape);
  };
  EXPECT_GT(bytes(large, 1), bytes(small, 1));
  EXPECT_LT(bytes(large, 8), bytes(large, 1));
  // The math backend's scores are bounded per head group, never below one head.
  shardit::models::StepShape efficient = large;
  efficient.attention_backend = "memory_efficient";
  EXPECT_LT(bytes(efficient, 1), bytes(large, 1));
  EXPECT_THAT(error_of([&] {
                shardit::models::StepShape odd = small;
                odd.width = 520;
                bytes(odd, 1);
              }),
              HasSubstr("multiples of 16"));
}

/// A copy of `source`'s config.json alone in a fresh folder.
std::string config_only(const std::string& source, const std::string& tag) {
  const std::string dir = shardit::testing::make_temp_dir(tag);
  fs::copy_file(source + "/config.json", dir + "/config.json");
  return dir;
}

nlohmann::json inspect_json(const std::string& arguments, int* status) {
  std::string output;
  *status = shardit::testing::run_command(shardit::testing::cli_path() + " inspect --plan --json " + arguments, &output);
  try {
    return nlohmann::json::parse(output);
  } catch (const std::exception&) {
    ADD_FAILURE() << "not JSON: " << output;
    return {};
  }
}

TEST(MemoryPlanCli, ConfigOnlyFolderGivesTheSummaryAsJson) {
  int status = 0;
  const nlohmann::json json = inspect_json("--tp 8 --tp-plan reference --dtype bf16 --height 1024 --width 1024 "
                                           "--device-memory 80 " + fixture("qwen_image"), &status);
  ASSERT_EQ(status, 0);
  ASSERT_EQ(json["components"].size(), 1u);
  const auto& component = json["components"][0];
  EXPECT_EQ(component["plan"], "reference");
  EXPECT_EQ(component["class_name"], "QwenImageTransformer2DModel");
  for (const char* key : {"parameters_total", "parameters_replicated", "parameters_sharded", "per_rank_parameters",
                          "per_rank_bytes"}) {
    EXPECT_TRUE(component.contains(key)) << key;
  }
  EXPECT_LT(component["plans"]["full"]["per_rank_bytes"].get<int64_t>(), component["per_rank_bytes"].get<int64_t>());
  EXPECT_GT(json["activations"]["transformer_step_bytes_per_rank"].get<int64_t>(), 0);
  EXPECT_EQ(json["verdicts"].size(), 8u);  // TP 1, 2, 4, 8 x both plans
}

// `inspect --plan` on the vae/ folder and on the pipeline folder: the VAE row counts the encoder.
TEST(MemoryPlanCli, QwenImageVaeCountsEncoderAndDecoder) {
  for (const std::string folder : {"qwen_image_edit_2511/vae", "qwen_image_edit_2511"}) {
    SCOPED_TRACE(folder);
    int status = 0;
    const nlohmann::json json = inspect_json("--tp 2 --dtype bf16 --height 1024 --width 1024 " + fixture(folder), &status);
    ASSERT_EQ(status, 0);
    int found = 0;
    for (const auto& component : json["components"]) {
      if (component["class_name"] != "AutoencoderKLQwenImage") continue;
      ++found;
      EXPECT_EQ(component["plan"], "replicated");
      EXPECT_EQ(component["parameters_total"].get<int64_t>(), kQwenImageVaeParameters);
      EXPECT_EQ(component["per_rank_bytes"].get<int64_t>(), kQwenImageVaeParameters * 2);
    }
    EXPECT_EQ(found, 1);
  }
}

// Qwen-Image-Edit-2511 at TP 2, 4 and 8: the transformer at --tp, the text encoder (28 heads,
// its vision tower included) at the largest divisor of --tp it allows, as the pipeline loads it
// (4 at TP 8), the VAE replicated; --text-encoder-tp 8 is the resolver's refusal with the degrees.
TEST(MemoryPlanCli, QwenImageEditTextEncoderAtItsOwnDegree) {
  int64_t transformer_at_2 = 0;
  int64_t text_encoder_at_4 = 0;
  for (const int tp : {2, 4, 8}) {
    SCOPED_TRACE(tp);
    int status = 0;
    const nlohmann::json json =
        inspect_json("--tp " + std::to_string(tp) + " --dtype bf16 " + fixture("qwen_image_edit_2511"), &status);
    ASSERT_EQ(status, 0);
    std::map<std::string, nlohmann::json> by_class;
    for (const auto& component : json["components"]) by_class[component["class_name"]] = component;
    ASSERT_EQ(by_class.size(), 3u);
    const auto& transformer = by_class.at("QwenImageTransformer2DModel");
    const auto& text_encoder = by_class.at("Qwen2_5_VLForConditionalGeneration");
    EXPECT_EQ(transformer["tp_degree"].get<int>(), tp);
    EXPECT_EQ(text_encoder["tp_degree"].get<int>(), tp == 8 ? 4 : tp);
    EXPECT_EQ(by_class.at("AutoencoderKLQwenImage")["per_rank_bytes"].get<int64_t>(), kQwenImageVaeParameters * 2);
    if (tp == 2) transformer_at_2 = transformer["per_rank_bytes"].get<int64_t>();
    if (tp == 4) text_encoder_at_4 = text_encoder["per_rank_bytes"].get<int64_t>();
    if (tp == 8) {
      // The transformer keeps shrinking; the text encoder stays at its TP=4 share.
      EXPECT_LT(transformer["per_rank_bytes"].get<int64_t>(), transformer_at_2 / 3);
      EXPECT_EQ(text_encoder["per_rank_bytes"].get<int64_t>(), text_encoder_at_4);
    }
  }
  std::string output;
  EXPECT_NE(shardit::testing::run_command(shardit::testing::cli_path() + " inspect --plan --json --tp 8 --text-encoder-tp 8 " +
                                              fixture("qwen_image_edit_2511") + " 2>&1",
                                          &output),
            0);
  EXPECT_THAT(output, HasSubstr("degrees that would work (up to 64): 1, 2, 4"));
}

TEST(MemoryPlanCli, UnknownClassHasTheSameErrorAsWithWeights) {
  const std::string dir = shardit::testing::make_temp_dir("planner-unknown");
  std::ofstream(dir + "/config.json") << R"({"_class_name": "SD3Transformer2DModel"})";
  std::string output;
  EXPECT_NE(shardit::testing::run_command(shardit::testing::cli_path() + " inspect --plan " + dir + " 2>&1", &output), 0);
  EXPECT_THAT(output, HasSubstr("unsupported model class 'SD3Transformer2DModel'"));
  EXPECT_THAT(output, HasSubstr("FluxTransformer2DModel"));
}

TEST(MemoryPlanCli, GoldenConfigOnlyErrorsMatchTheFolderWithWeights) {
  // The FLUX.1 golden model has 4 heads: TP=3 cannot divide, with or without the weights.
  const std::string with_weights = shardit::testing::golden_path("pipeline_flux1/transformer");
  const std::string without = config_only(with_weights, "planner-golden");
  std::string expected;
  std::string got;
  EXPECT_NE(shardit::testing::run_command(shardit::testing::cli_path() + " inspect --plan --tp 3 " + with_weights + " 2>&1",
                                          &expected), 0);
  EXPECT_NE(shardit::testing::run_command(shardit::testing::cli_path() + " inspect --plan --tp 3 " + without + " 2>&1", &got),
            0);
  const auto last_line = [](const std::string& text) {
    const std::string trimmed = text.substr(0, text.find_last_not_of('\n') + 1);
    return trimmed.substr(trimmed.find_last_of('\n') + 1);
  };
  EXPECT_THAT(last_line(got), HasSubstr("num_attention_heads"));
  EXPECT_EQ(last_line(got), last_line(expected));
  // A pipeline folder of configs only: transformer and VAE counted, the rest listed.
  const std::string pipeline = shardit::testing::make_temp_dir("planner-pipeline");
  fs::copy_file(shardit::testing::golden_path("pipeline_flux1/model_index.json"), pipeline + "/model_index.json");
  for (const char* component : {"transformer", "vae"}) {
    fs::create_directory(pipeline + "/" + component);
    fs::copy_file(shardit::testing::golden_path(std::string("pipeline_flux1/") + component + "/config.json"),
                  pipeline + "/" + component + "/config.json");
  }
  int status = 0;
  const nlohmann::json json = inspect_json("--tp 2 --height 64 --width 64 " + pipeline, &status);
  EXPECT_EQ(status, 0);
  EXPECT_EQ(json["components"].size(), 2u);
  EXPECT_EQ(json["components"][1]["plan"], "replicated");
  EXPECT_GT(json["activations"]["vae_decode_bytes"].get<int64_t>(), 0);
}

}  // namespace
}  // namespace test_memory_plan
