// Qwen2.5-VL with its vision tower (models/qwen/modeling_qwen2_5_vl.h) against transformers
// 4.57.6 through diffusers' QwenImageEditPlusPipeline._get_qwen_prompt_embeds
// (tests/golden/edit_qwenimage): the tower's tokens, the M-RoPE positions, and the prompt
// embeddings and mask for 1, 2 and 3 images. The tower has a windowed block (0) and a
// full-attention block (1); the images span one to three windows.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <string>

#include "shardit/io/image.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/pipelines/pipeline_qwenimage_edit_plus.h"
#include "shardit/tokenizers/tokenizer.h"
#include "support/qwen_edit_case.h"
#include "support/test_support.h"

namespace shardit {
namespace test_parity_qwen2_5_vl_vision {
namespace {

using testing::golden_path;
using testing::tensors_close;

// fp32 against fp32: the golden set's tolerance for transformer tensors (1e-4 + 1e-4 |expected|);
// the only differences are the order of float sums (the patch embedding as a convolution, the
// attention kernels).
TEST(ParityQwen2_5_VLVision, GoldenPromptEmbedsWithImages) {
  auto model = testing::load_edit_text_encoder();
  const auto produced = testing::run_edit_encoder_cases(*model);
  const auto golden = io::SafetensorsFile::open(golden_path("edit_qwenimage") + "/outputs.safetensors");
  int compared = 0;
  for (const auto& [name, value] : produced) {
    ASSERT_TRUE(golden->contains(name)) << name;
    const at::Tensor expected = golden->read(name);
    if (name.find("position_ids") != std::string::npos || name.find("mask") != std::string::npos) {
      EXPECT_TRUE(at::equal(value.to(at::kLong), expected.to(at::kLong))) << name;
    } else {
      std::cout << name << " " << expected.sizes() << ": max |diff| "
                << (value.to(at::kDouble) - expected.to(at::kDouble)).abs().max().item<double>() << ", max |expected| "
                << expected.abs().max().item<double>() << "\n";
      EXPECT_TRUE(tensors_close(name, value, expected, 1e-4, 1e-4));
    }
    ++compared;
  }
  EXPECT_EQ(compared, 12);
}

// The whole of QwenImageEditPlusPipeline.encode_prompt from the source PNGs: condition sizes,
// LANCZOS, the processor, the tokens, the tower and the decoder (every step above exact but the
// fp32 sums).
TEST(ParityQwen2_5_VLVision, GoldenEditPlusEncodePromptFromSourceImages) {
  auto model = testing::load_edit_text_encoder();
  const std::string dir = golden_path("edit_qwenimage");
  const auto golden = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  const auto tokenizer = tokenizers::load_tokenizer(dir + "/tokenizer", tokenizers::TokenizerKind::Qwen);
  std::ifstream config_file(dir + "/processor/preprocessor_config.json");
  const auto processor =
      pipelines::Qwen2VLImageProcessorConfig::from_json(nlohmann::json::parse(config_file), "preprocessor_config.json");
  std::ifstream case_file(dir + "/case.json");
  const nlohmann::json cases = nlohmann::json::parse(case_file);
  for (const auto& c : cases.at("encoder")) {
    std::vector<at::Tensor> images;
    for (const auto& png : c.at("images")) images.push_back(io::read_image(dir + "/" + png.get<std::string>()));
    const auto embeds = pipelines::qwenimage_edit_plus_encode_prompt(*model, *tokenizer, processor,
                                                                     c.at("prompt").get<std::string>(), images);
    const std::string key = "encoder." + c.at("name").get<std::string>();
    EXPECT_TRUE(tensors_close(key + ".prompt_embeds from the PNGs", embeds.prompt_embeds,
                              golden->read(key + ".prompt_embeds"), 1e-4, 1e-4));
    EXPECT_TRUE(at::equal(embeds.prompt_embeds_mask, golden->read(key + ".prompt_embeds_mask"))) << key;
  }
}

TEST(ParityQwen2_5_VLVision, GoldenCheckpointKeysAndPlan) {
  auto model = testing::load_edit_text_encoder();
  ASSERT_NE(model->visual, nullptr);
  // Every vision tensor was read (load fails on a missing one); the plan shards the tower's heads.
  const auto plan = model->resolve(2);
  EXPECT_EQ(plan.spec("visual.blocks.0.attn.qkv.weight").local_shape(0), (std::vector<int64_t>{48, 32}));
  EXPECT_EQ(plan.spec("visual.blocks.0.attn.proj.weight").local_shape(0), (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(plan.spec("visual.merger.mlp.0.weight").local_shape(1), (std::vector<int64_t>{64, 128}));
}

TEST(ParityQwen2_5_VLVision, ImpossibleVisionDegreeListsTheWorkingOnes) {
  const auto folder = io::open_component(golden_path("edit_qwenimage"), "text_encoder");
  const std::string source = folder.dir + "/config.json";
  const models::Qwen3Config text = models::qwen2_5_vl_text_config_from_json(folder.config, source);
  auto image = models::qwen2_5_vl_image_config_from_json(folder.config, source, text);
  models::Qwen2_5_VLForConditionalGeneration model(text, image);
  // 2 vision heads: TP=4 divides the text model's 4 heads but not the tower's.
  const std::string message = testing::error_of([&] { model.resolve(4); });
  EXPECT_NE(message.find("vision_config.num_heads"), std::string::npos) << message;
  EXPECT_NE(message.find("1, 2"), std::string::npos) << message;
}

TEST(ParityQwen2_5_VLVision, PadCountMismatchIsNamed) {
  auto model = testing::load_edit_text_encoder();
  const auto golden = io::SafetensorsFile::open(golden_path("edit_qwenimage") + "/outputs.safetensors");
  const at::Tensor ids = golden->read("encoder.one.input_ids");
  const at::Tensor mask = golden->read("encoder.one.attention_mask");
  const at::Tensor grid = golden->read("encoder.one.image_grid_thw");
  const int64_t patches = (grid[0][1] * grid[0][2]).item<int64_t>();
  const at::Tensor pixels = at::zeros({patches, 1176});
  // Drop one pad token: 17 pads for 18 features.
  const at::Tensor pad_positions = ids[0].eq(model->image_config->image_token_id).nonzero().flatten();
  const int64_t cut = pad_positions[0].item<int64_t>();
  const at::Tensor fewer = at::cat({ids.slice(1, 0, cut), ids.slice(1, cut + 1)}, 1);
  const std::string message =
      testing::error_of([&] { model->forward_with_images(fewer, mask.slice(1, 1), pixels, grid); });
  EXPECT_NE(message.find("image tokens but the images give 18 features"), std::string::npos) << message;
}

}  // namespace
}  // namespace test_parity_qwen2_5_vl_vision
}  // namespace shardit
