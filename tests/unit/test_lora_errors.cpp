// Bad LoRA adapters get errors naming the file, the key and the module, before any weight or
// layer changes: the model gives its base output afterwards, bit for bit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "apps/commands.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/lora_formats.h"
#include "shardit/nn/linear.h"
#include "shardit/parallel/lora.h"
#include "support/test_support.h"

namespace shardit {
namespace test_lora_errors {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::error_of;
using testing::golden_path;
using testing::load_transformer;
using testing::run_case;

using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

Tensors read_all(const std::string& path) {
  const auto file = io::SafetensorsFile::open(path);
  Tensors tensors;
  for (const std::string& name : file->names()) tensors.emplace_back(name, file->read(name));
  return tensors;
}

std::string write(const std::string& name, const Tensors& tensors) {
  const std::string path = testing::make_temp_dir("lora-errors") + "/" + name;
  io::save_safetensors(path, tensors);
  return path;
}

/// Loading `path` into the FLUX.1 golden model fails with a message holding every one of
/// `fragments`, and the model is unchanged afterwards.
void expect_rejected(const std::string& case_name, const std::string& path, const std::vector<std::string>& fragments) {
  const std::string dir = golden_path(case_name);
  auto model = load_transformer(dir);
  const at::Tensor before = run_case(*model, dir);
  parallel::LoraAdapters adapters(*model);
  const std::string message = error_of([&] { adapters.load("bad", models::read_lora_spec(path, *model)); });
  for (const std::string& fragment : fragments) EXPECT_THAT(message, HasSubstr(fragment));
  EXPECT_TRUE(adapters.names().empty());
  for (const auto& [name, module] : model->named_modules()) {
    if (auto* layer = dynamic_cast<nn::Linear*>(module)) {
      EXPECT_TRUE(layer->loras().empty()) << name;
    }
  }
  EXPECT_TRUE(at::equal(run_case(*model, dir), before));
}

TEST(LoraErrors, GoldenWrongFamilyNamesFileKeyAndModule) {
  // A FLUX.2 BFL LoRA on FLUX.1: linear1 (FLUX.2's fused q|k|v|gate|up) is wider than FLUX.1's
  // q|k|v|mlp.
  const std::string path = golden_path("lora_flux2_bfl/bfl.safetensors");
  expect_rejected("lora_flux1_peft", path, {path, "diffusion_model.single_blocks.0.linear1.lora_B.weight",
                                            "single_transformer_blocks.0.proj_mlp", "576 rows"});
  // A Qwen-Image kohya LoRA on FLUX.1: its names are no FLUX.1 module.
  const std::string qwen = golden_path("lora_qwenimage_kohya/kohya.safetensors");
  expect_rejected("lora_flux1_peft", qwen, {qwen, "lora_unet_transformer_blocks_0_attn_add_k_proj", "FLUX.1"});
  // A FLUX.1 diffusers LoRA on Qwen-Image: proj_mlp does not exist there.
  const std::string flux = golden_path("lora_flux1_peft/pixel.safetensors");
  expect_rejected("lora_qwenimage_peft", flux, {flux, "single_transformer_blocks.0", "QwenImageTransformer2DModel"});
}

TEST(LoraErrors, GoldenWrongRankShapesNameTheKey) {
  Tensors tensors = read_all(golden_path("lora_flux1_peft/pixel.safetensors"));
  const std::string key = "transformer.transformer_blocks.1.attn.to_v.lora_B.weight";
  for (auto& [name, tensor] : tensors) {
    if (name == key) tensor = at::zeros({64, 3});
  }
  const std::string path = write("rank.safetensors", tensors);
  expect_rejected("lora_flux1_peft", path, {path, key, "rank 3", "transformer_blocks.1.attn.to_v"});

  // Input width of another model.
  Tensors wide = read_all(golden_path("lora_flux1_peft/pixel.safetensors"));
  const std::string a_key = "transformer.transformer_blocks.0.attn.to_q.lora_A.weight";
  for (auto& [name, tensor] : wide) {
    if (name == a_key) tensor = at::zeros({4, 128});
  }
  const std::string wide_path = write("wide.safetensors", wide);
  expect_rejected("lora_flux1_peft", wide_path, {wide_path, a_key, "64 input features"});
}

TEST(LoraErrors, GoldenTruncatedFileIsNamed) {
  // A factor without its partner.
  Tensors tensors = read_all(golden_path("lora_flux1_peft/pixel.safetensors"));
  const std::string key = "transformer.single_transformer_blocks.1.proj_out.lora_B.weight";
  Tensors without;
  for (auto& entry : tensors) {
    if (entry.first != key) without.push_back(entry);
  }
  const std::string path = write("partner.safetensors", without);
  expect_rejected("lora_flux1_peft", path, {path, "single_transformer_blocks.1.proj_out", "truncated"});

  // Bytes cut off the end.
  const std::string source = golden_path("lora_flux1_peft/pixel.safetensors");
  std::ifstream in(source, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = testing::make_temp_dir("lora-errors") + "/cut.safetensors";
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() - 100);
  expect_rejected("lora_flux1_peft", cut, {cut});
}

TEST(LoraErrors, GoldenUnknownKeysAreNamed) {
  Tensors tensors = read_all(golden_path("lora_flux1_peft/pixel.safetensors"));
  tensors.emplace_back("transformer.transformer_blocks.0.attn.to_qq.lora_A.weight", at::zeros({4, 64}));
  tensors.emplace_back("transformer.transformer_blocks.0.attn.to_qq.lora_B.weight", at::zeros({64, 4}));
  const std::string path = write("module.safetensors", tensors);
  expect_rejected("lora_flux1_peft", path, {path, "transformer.transformer_blocks.0.attn.to_qq.lora_B.weight",
                                            "transformer_blocks.0.attn.to_qq", "not a Linear"});

  Tensors odd = read_all(golden_path("lora_flux1_peft/pixel.safetensors"));
  odd.emplace_back("transformer.transformer_blocks.0.attn.to_q.magnitude", at::zeros({64}));
  const std::string odd_path = write("odd.safetensors", odd);
  expect_rejected("lora_flux1_peft", odd_path, {odd_path, "transformer.transformer_blocks.0.attn.to_q.magnitude"});

  const std::string unknown = write("unknown.safetensors", {{"model.layers.0.weight", at::zeros({2, 2})}});
  expect_rejected("lora_flux1_peft", unknown, {unknown, "unknown LoRA format", "model.layers.0.weight"});
}

TEST(LoraErrors, GoldenSetAdaptersNamesUnknownAdapter) {
  auto model = load_transformer(golden_path("lora_flux1_peft"));
  parallel::LoraAdapters adapters(*model);
  adapters.load("pixel", models::read_lora_spec(golden_path("lora_flux1_peft/pixel.safetensors"), *model));
  EXPECT_THAT(error_of([&] { adapters.set_adapters({"style"}, {1.0}); }),
              AllOf(HasSubstr("'style' is not loaded"), HasSubstr("pixel")));
  EXPECT_THAT(error_of([&] { adapters.set_adapters({"pixel"}, {}); }), HasSubstr("1 adapter names but 0 weights"));
  EXPECT_THAT(error_of([&] {
                adapters.load("pixel", models::read_lora_spec(golden_path("lora_flux1_peft/pixel.safetensors"), *model));
              }),
              HasSubstr("'pixel' is already loaded"));
}

TEST(LoraRequest, ParsesFileAndWeight) {
  EXPECT_EQ(apps::parse_lora_request("a.safetensors").path, "a.safetensors");
  EXPECT_EQ(apps::parse_lora_request("a.safetensors").weight, 1.0);
  EXPECT_EQ(apps::parse_lora_request("a.safetensors:0.7").weight, 0.7);
  EXPECT_EQ(apps::parse_lora_request("a.safetensors:-0.3").path, "a.safetensors");
  EXPECT_EQ(apps::parse_lora_request("c:/x/a.safetensors").path, "c:/x/a.safetensors");
  EXPECT_EQ(models::lora_adapter_name("dir/pixel.safetensors"), "pixel");
}

}  // namespace
}  // namespace test_lora_errors
}  // namespace shardit
