// LoRA adapters against diffusers' golden LoRA cases (lora_*/): every format converted, loaded
// unfused (sample, and sample_scaled under the case's lora_scale), switched between forwards, and
// fused (merged weights and sample_fused). Samples: 1e-4 + 1e-4|b| as for the transformer goldens;
// merged weights: 1e-6 absolute (diffusers' own float64 cross-check of its merge is <= 1.1e-7).
#include <gtest/gtest.h>

#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "shardit/io/safetensors.h"
#include "shardit/models/lora_formats.h"
#include "shardit/nn/linear.h"
#include "shardit/parallel/lora.h"
#include "shardit/verify/lora_case.h"
#include "support/test_support.h"

namespace shardit {
namespace test_parity_lora {
namespace {

using testing::golden_path;
using testing::load_transformer;
using testing::run_case;
using testing::tensors_close;

constexpr double kTol = 1e-4;
constexpr double kMergedTol = 1e-6;

class LoraParity : public ::testing::TestWithParam<std::string> {};

TEST_P(LoraParity, UnfusedSampleMatchesDiffusers) {
  const std::string dir = golden_path(GetParam());
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  auto model = load_transformer(dir);
  const verify::LoraCase lora_case = verify::read_lora_case(dir);
  auto adapters = verify::load_lora_case(*model, lora_case);

  const auto sample = tensors_close(GetParam() + " sample", run_case(*model, dir), outputs->read("sample"), kTol, kTol);
  EXPECT_TRUE(sample);
  std::cout << "  " << sample.message() << "\n";
  if (outputs->contains("sample_scaled")) {
    adapters->set_scale(lora_case.lora_scale);
    const auto scaled =
        tensors_close(GetParam() + " sample_scaled", run_case(*model, dir), outputs->read("sample_scaled"), kTol, kTol);
    EXPECT_TRUE(scaled);
    std::cout << "  " << scaled.message() << "\n";
  } else {
    EXPECT_EQ(lora_case.lora_scale, 1.0) << "a case with lora_scale != 1 has sample_scaled";
  }
}

TEST_P(LoraParity, FusedWeightsAndSampleMatchDiffusers) {
  const std::string dir = golden_path(GetParam());
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  auto model = load_transformer(dir);
  const verify::LoraCase lora_case = verify::read_lora_case(dir);
  auto adapters = verify::load_lora_case(*model, lora_case);
  adapters->fuse(lora_case.lora_scale);
  EXPECT_TRUE(adapters->names().empty());

  int merged = 0;
  for (const std::string& name : outputs->names()) {
    if (name.rfind("merged.", 0) != 0) continue;
    const std::string parameter = name.substr(7);
    const std::string module = parameter.substr(0, parameter.size() - 7);  // without ".weight"
    auto* layer = dynamic_cast<nn::Linear*>(model->find_module(module));
    ASSERT_NE(layer, nullptr) << name;
    EXPECT_TRUE(layer->loras().empty()) << module << " still holds unfused adapters";
    EXPECT_TRUE(tensors_close(GetParam() + " " + name, layer->weight, outputs->read(name), kMergedTol, 0.0));
    ++merged;
  }
  EXPECT_EQ(merged, 3);
  const auto fused =
      tensors_close(GetParam() + " sample_fused", run_case(*model, dir), outputs->read("sample_fused"), kTol, kTol);
  EXPECT_TRUE(fused);
  std::cout << "  " << fused.message() << "\n";
}

// One loaded model, adapters switched off, re-weighted and back between forwards, must give what a
// freshly loaded model gives in each state, bit for bit (the same operations in the same order).
TEST_P(LoraParity, SwitchingAdaptersEqualsLoadingFresh) {
  const std::string dir = golden_path(GetParam());
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  const verify::LoraCase lora_case = verify::read_lora_case(dir);
  const at::Tensor base = run_case(*load_transformer(dir), dir);
  EXPECT_TRUE(tensors_close(GetParam() + " sample_base", base, outputs->read("sample_base"), kTol, kTol));
  auto model = load_transformer(dir);
  auto adapters = verify::load_lora_case(*model, lora_case);
  const at::Tensor first = run_case(*model, dir);

  adapters->set_adapters({}, {});
  EXPECT_TRUE(tensors_close(GetParam() + " no adapter active", run_case(*model, dir), base, 0.0, 0.0));

  std::vector<double> halved;
  for (const double weight : lora_case.weights) halved.push_back(weight * 0.5);
  adapters->set_adapters(lora_case.active, halved);
  adapters->set_scale(1.5);
  const at::Tensor switched = run_case(*model, dir);
  auto fresh_model = load_transformer(dir);
  auto fresh = verify::load_lora_case(*fresh_model, lora_case);
  fresh->set_adapters(lora_case.active, halved);
  fresh->set_scale(1.5);
  EXPECT_TRUE(tensors_close(GetParam() + " re-weighted vs fresh", switched, run_case(*fresh_model, dir), 0.0, 0.0));
  EXPECT_FALSE(at::equal(switched, first));

  adapters->set_adapters(lora_case.active, lora_case.weights);
  adapters->set_scale(1.0);
  EXPECT_TRUE(tensors_close(GetParam() + " switched back", run_case(*model, dir), first, 0.0, 0.0));

  // Unloading every adapter gives the base model back.
  for (const std::string& name : adapters->names()) adapters->unload(name);
  EXPECT_TRUE(tensors_close(GetParam() + " unloaded", run_case(*model, dir), base, 0.0, 0.0));
}

INSTANTIATE_TEST_SUITE_P(Golden, LoraParity,
                         ::testing::Values("lora_flux1_peft", "lora_flux1_two_adapters", "lora_flux1_kohya",
                                           "lora_flux1_xlabs", "lora_flux2_peft", "lora_flux2_two_adapters",
                                           "lora_flux2_bfl", "lora_qwenimage_peft", "lora_qwenimage_two_adapters",
                                           "lora_qwenimage_kohya"));

}  // namespace
}  // namespace test_parity_lora
}  // namespace shardit

namespace shardit {
namespace test_parity_lora {
namespace {

/// `shardit [--nproc-per-node N] run-transformer` with the case's adapters and weights, unfused
/// with --lora-scale (sample_scaled, or sample when the case's scale is 1) and with --fuse-lora
/// (sample_fused).
void expect_cli_matches(const std::string& case_name, int nproc) {
  const std::string dir = testing::golden_path(case_name);
  const verify::LoraCase lora_case = verify::read_lora_case(dir);
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  std::string loras;
  for (size_t i = 0; i < lora_case.adapters.size(); ++i) {
    loras += " --lora " + lora_case.adapters[i].file + ":" + std::to_string(lora_case.weights[i]);
  }
  const std::string out_dir = testing::make_temp_dir("lora-cli");
  for (const bool fuse : {false, true}) {
    const std::string out = out_dir + (fuse ? "/fused.safetensors" : "/unfused.safetensors");
    std::string output;
    const std::string command = testing::cli_path() + (nproc > 1 ? " --nproc-per-node " + std::to_string(nproc) : "") +
                                " run-transformer --model " + dir + " --inputs " + dir + " --out " + out + loras +
                                " --lora-scale " + std::to_string(lora_case.lora_scale) + (fuse ? " --fuse-lora" : "");
    ASSERT_EQ(testing::run_command(command, &output), 0) << command << "\n" << output;
    const std::string expected = fuse ? "sample_fused" : outputs->contains("sample_scaled") ? "sample_scaled" : "sample";
    const auto result = testing::tensors_close(case_name + " CLI " + expected + " (" + std::to_string(nproc) + " ranks)",
                                               io::SafetensorsFile::open(out)->read("sample"), outputs->read(expected),
                                               1e-4, 1e-4);
    EXPECT_TRUE(result);
    std::cout << "  " << result.message() << "\n";
  }
}

TEST(LoraCli, GoldenTwoAdaptersWithScale) { expect_cli_matches("lora_flux1_two_adapters", 1); }
TEST(LoraCli, GoldenKohyaAtTwoRanks) { expect_cli_matches("lora_flux1_kohya", 2); }
TEST(LoraCli, GoldenQwenImageTwoAdaptersAtFourRanks) { expect_cli_matches("lora_qwenimage_two_adapters", 4); }

TEST(LoraCli, GoldenInspectPrintsFormatTargetsAndRankBytes) {
  const std::string dir = testing::golden_path("lora_flux1_kohya");
  std::string output;
  ASSERT_EQ(testing::run_command(testing::cli_path() + " inspect " + dir + "/kohya.safetensors --model " + dir +
                                     " --plan --tp 2",
                                 &output),
            0)
      << output;
  EXPECT_NE(output.find("format kohya, rank 8, alpha 2, 12"), std::string::npos) << output;
  EXPECT_NE(output.find("single_transformer_blocks.0.proj_mlp"), std::string::npos) << output;
  EXPECT_NE(output.find("rows [192, 448)"), std::string::npos) << output;
  EXPECT_NE(output.find("rank 1 of TP=2:"), std::string::npos) << output;
}

}  // namespace
}  // namespace test_parity_lora
}  // namespace shardit

namespace shardit {
namespace test_parity_lora {
namespace {

/// The case's sample with adapter `replaced` read from `path` instead (same name and weight).
void expect_variant_gives_sample(const std::string& case_name, const std::string& replaced, const std::string& path) {
  const std::string dir = testing::golden_path(case_name);
  verify::LoraCase lora_case = verify::read_lora_case(dir);
  for (auto& adapter : lora_case.adapters) {
    if (adapter.name == replaced) adapter.file = path;
  }
  auto model = testing::load_transformer(dir);
  auto adapters = verify::load_lora_case(*model, lora_case);
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  EXPECT_TRUE(testing::tensors_close(case_name + " sample via " + path, testing::run_case(*model, dir),
                                     outputs->read("sample"), 1e-4, 1e-4));
}

std::string rewrite(const std::string& source, const std::string& name,
                    const std::function<std::string(const std::string&)>& rename,
                    const std::vector<std::pair<std::string, at::Tensor>>& extra = {}) {
  const auto file = io::SafetensorsFile::open(source);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const std::string& key : file->names()) tensors.emplace_back(rename(key), file->read(key));
  for (const auto& entry : extra) tensors.push_back(entry);
  const std::string path = testing::make_temp_dir("lora-variants") + "/" + name;
  io::save_safetensors(path, tensors);
  return path;
}

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

// PEFT's `base_model.model.` prefix and `.default.` adapter names read as BFL `diffusion_model.`.
TEST(LoraVariants, GoldenPeftPrefixAndAdapterNameKeys) {
  const std::string path =
      rewrite(testing::golden_path("lora_flux2_bfl/bfl.safetensors"), "bfl_peft.safetensors", [](const std::string& key) {
        return replace_all(replace_all(key, "diffusion_model.", "base_model.model."), ".weight", ".default.weight");
      });
  expect_variant_gives_sample("lora_flux2_bfl", "bfl", path);
}

// XLabs keys under ComfyUI's `diffusion_model.` prefix.
TEST(LoraVariants, GoldenXlabsWithDiffusionModelPrefix) {
  const std::string path = rewrite(testing::golden_path("lora_flux1_xlabs/xlabs.safetensors"), "xlabs_prefixed.safetensors",
                                   [](const std::string& key) { return "diffusion_model." + key; });
  expect_variant_gives_sample("lora_flux1_xlabs", "xlabs", path);
}

// lora_alpha / r from per-module `.alpha` keys instead of the metadata (detail: alpha 4, r 8).
TEST(LoraVariants, GoldenAlphaKeysInsteadOfMetadata) {
  const std::string source = testing::golden_path("lora_flux1_two_adapters/detail.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> alphas;
  for (const std::string& key : io::SafetensorsFile::open(source)->names()) {
    const std::string suffix = ".lora_A.weight";
    if (key.size() > suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0) {
      alphas.emplace_back(key.substr(0, key.size() - suffix.size()) + ".alpha", at::scalar_tensor(4.0));
    }
  }
  const std::string path =
      rewrite(source, "detail_alpha.safetensors", [](const std::string& key) { return key; }, alphas);
  ASSERT_TRUE(io::SafetensorsFile::open(path)->metadata().count("lora_adapter_metadata") == 0);
  expect_variant_gives_sample("lora_flux1_two_adapters", "detail", path);
}

// kohya names on the ComfyUI prefix: `diffusion_model.<BFL module>.lora_down.weight` + alpha.
TEST(LoraVariants, GoldenComfyUiKohyaNames) {
  const std::string source = testing::golden_path("lora_flux1_kohya/kohya.safetensors");
  const std::string path = rewrite(source, "comfy.safetensors", [](const std::string& key) {
    const size_t dot = key.find('.');
    std::string stem = key.substr(std::string("lora_unet_").size(), dot - 10);
    // double_blocks_0_img_attn_qkv -> double_blocks.0.img_attn.qkv (only the block index needs dots:
    // the converter compares names with `_`)
    return "diffusion_model." + replace_all(stem, "_blocks_", "_blocks.") + key.substr(dot);
  });
  expect_variant_gives_sample("lora_flux1_kohya", "kohya", path);
}

}  // namespace
}  // namespace test_parity_lora
}  // namespace shardit
