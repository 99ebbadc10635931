// Qwen2.5-VL's image processor (pipelines/image_processing_qwen2_vl.h) and Qwen-Image editing's
// prompt text (tokenizers/prompt_templates.h) against what transformers' Qwen2VLImageProcessor /
// Qwen2VLProcessor and diffusers' QwenImageEditPlusPipeline made (tests/golden/edit_qwenimage):
// smart_resize's sizes and the grids exactly, the BICUBIC resize to Pillow's pixels, pixel_values
// bit for bit (SHA-256 of the float32 bytes), calculate_dimensions, the expanded prompt's ids.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "shardit/io/image.h"
#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "shardit/pipelines/image_processing_qwen2_vl.h"
#include "shardit/pipelines/image_processor.h"
#include "shardit/tokenizers/prompt_templates.h"
#include "shardit/tokenizers/tokenizer.h"
#include "support/sha256.h"
#include "support/test_support.h"

namespace shardit {
namespace test_image_processing_qwen2_vl {
namespace {

using pipelines::Qwen2VLImageProcessorConfig;
using testing::error_of;
using testing::golden_path;
using Size = std::pair<int64_t, int64_t>;

struct Golden {
  nlohmann::json cases;
  Qwen2VLImageProcessorConfig config;
  std::shared_ptr<io::SafetensorsFile> outputs;
  std::string dir;
};

const Golden& golden() {
  static const Golden g = [] {
    Golden out;
    out.dir = golden_path("edit_qwenimage");
    std::ifstream cases(out.dir + "/case.json");
    out.cases = nlohmann::json::parse(cases);
    const std::string config_path = out.dir + "/processor/preprocessor_config.json";
    std::ifstream config(config_path);
    out.config = Qwen2VLImageProcessorConfig::from_json(nlohmann::json::parse(config), config_path);
    out.outputs = io::SafetensorsFile::open(out.dir + "/outputs.safetensors");
    return out;
  }();
  return g;
}

std::string stem(const std::string& png) {  // "source_wide.png" -> "wide"
  return png.substr(std::string("source_").size(), png.size() - std::string("source_.png").size());
}

/// Max |a - b| in 8-bit levels, and how many values differ.
std::pair<int, int64_t> level_difference(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor difference = (a.to(at::kInt) - b.to(at::kInt)).abs();
  return {difference.max().item<int>(), difference.gt(0).sum().item<int64_t>()};
}

TEST(Qwen2VLImageProcessor, GoldenConfigRead) {
  const auto& config = golden().config;
  EXPECT_EQ(config.min_pixels, 56 * 56);
  EXPECT_EQ(config.max_pixels, 28 * 28 * 20);
  EXPECT_EQ(config.patch_size, 14);
  EXPECT_EQ(config.temporal_patch_size, 2);
  EXPECT_EQ(config.merge_size, 2);
  EXPECT_DOUBLE_EQ(config.rescale_factor, 1.0 / 255.0);
}

// smart_resize's size and the grid of every case, exactly.
TEST(Qwen2VLImageProcessor, GoldenSmartResizeAndGrid) {
  const auto& g = golden();
  ASSERT_GE(g.cases.at("processor").size(), 6u);
  for (const auto& c : g.cases.at("processor")) {
    const std::string name = stem(c.at("image"));
    const at::Tensor source = io::read_image(g.dir + "/" + c.at("image").get<std::string>());
    ASSERT_EQ(source.size(0), c.at("height").get<int64_t>()) << name;
    const auto [h, w] = pipelines::qwen2_vl_smart_resize(source.size(0), source.size(1), 28, g.config.min_pixels,
                                                         g.config.max_pixels);
    const auto grid = c.at("image_grid_thw").get<std::vector<int64_t>>();
    EXPECT_EQ((std::vector<int64_t>{1, h / 14, w / 14}), grid) << name;
    const at::Tensor resized = g.outputs->read("processor." + name + ".resized");
    EXPECT_EQ(resized.size(0), h) << name;
    EXPECT_EQ(resized.size(1), w) << name;
  }
}

// Pillow's BICUBIC, computed as Pillow computes it: the same 8-bit pixels as transformers' resize.
TEST(Qwen2VLImageProcessor, GoldenBicubicResizeMatchesPillow) {
  const auto& g = golden();
  for (const auto& c : g.cases.at("processor")) {
    const std::string name = stem(c.at("image"));
    const at::Tensor source = io::read_image(g.dir + "/" + c.at("image").get<std::string>());
    const at::Tensor expected = g.outputs->read("processor." + name + ".resized");
    const at::Tensor resized = pipelines::resize_bicubic(source, expected.size(0), expected.size(1));
    const auto [max_levels, differing] = level_difference(resized, expected);
    std::cout << name << ": " << differing << " of " << expected.numel() << " values differ, by at most "
              << max_levels << " levels\n";
    EXPECT_EQ(max_levels, 0) << name;
  }
}

// Rescale, normalize and the patch layout: the golden resized image gives pixel_values whose
// float32 bytes hash as transformers' did; the whole path from the source PNG does too.
TEST(Qwen2VLImageProcessor, GoldenPixelValuesBitForBit) {
  const auto& g = golden();
  for (const auto& c : g.cases.at("processor")) {
    const std::string name = stem(c.at("image"));
    const auto shape = c.at("pixel_values_shape").get<std::vector<int64_t>>();
    const auto from_resized =
        pipelines::qwen2_vl_patchify(g.outputs->read("processor." + name + ".resized"), g.config);
    EXPECT_EQ(from_resized.pixel_values.sizes().vec(), shape) << name;
    EXPECT_TRUE(at::equal(from_resized.pixel_values[0], g.outputs->read("processor." + name + ".pixel_values_first_row")))
        << name;
    EXPECT_TRUE(at::equal(from_resized.pixel_values[-1], g.outputs->read("processor." + name + ".pixel_values_last_row")))
        << name;
    EXPECT_EQ(testing::sha256_hex(from_resized.pixel_values), c.at("pixel_values_sha256").get<std::string>()) << name;

    const at::Tensor source = io::read_image(g.dir + "/" + c.at("image").get<std::string>());
    const auto whole = pipelines::qwen2_vl_preprocess(source, g.config);
    EXPECT_EQ(testing::sha256_hex(whole.pixel_values), c.at("pixel_values_sha256").get<std::string>()) << name;
    EXPECT_EQ((std::vector<int64_t>(whole.grid_thw.begin(), whole.grid_thw.end())),
              c.at("image_grid_thw").get<std::vector<int64_t>>())
        << name;
  }
}

// QwenImageEditPlusPipeline.__call__'s condition images: calculate_dimensions to the 384² area,
// LANCZOS (VaeImageProcessor.resize), then the processor; and the prompt's token ids.
TEST(QwenImageEditPlusConditioning, GoldenConditionImagesAndInputIds) {
  const auto& g = golden();
  const auto tokenizer = tokenizers::load_tokenizer(g.dir + "/tokenizer", tokenizers::TokenizerKind::Qwen);
  ASSERT_EQ(g.cases.at("encoder").size(), 3u);
  for (const auto& c : g.cases.at("encoder")) {
    const std::string key = c.at("name");
    std::vector<pipelines::Qwen2VLImageInputs> images;
    for (size_t i = 0; i < c.at("images").size(); ++i) {
      const at::Tensor source = io::read_image(g.dir + "/" + c.at("images")[i].get<std::string>());
      const auto& size = c.at("condition_sizes")[i];
      const auto [width, height] = pipelines::qwenimage_edit_calculate_dimensions(
          pipelines::kQwenImageEditConditionArea,
          static_cast<double>(source.size(1)) / static_cast<double>(source.size(0)));
      EXPECT_EQ(width, size.at("width").get<int64_t>()) << key << " image " << i;
      EXPECT_EQ(height, size.at("height").get<int64_t>()) << key << " image " << i;
      const at::Tensor condition = pipelines::resize_lanczos(source, height, width);
      const at::Tensor expected = g.outputs->read("encoder." + key + ".processor_image." + std::to_string(i));
      const auto processed = pipelines::qwen2_vl_preprocess(condition, g.config);
      const auto [max_levels, differing] = level_difference(processed.resized, expected);
      std::cout << key << " image " << i << ": after the processor's BICUBIC " << differing
                << " values differ, by at most " << max_levels << " levels\n";
      EXPECT_EQ(testing::sha256_hex(condition), size.at("pixels_sha256").get<std::string>())
          << key << " image " << i << ": the LANCZOS condition image differs from Pillow's";
      EXPECT_EQ(max_levels, 0) << key << " image " << i;
      images.push_back(processed);
    }
    const auto batch = pipelines::qwen2_vl_batch(images);
    EXPECT_TRUE(at::equal(batch.image_grid_thw, g.outputs->read("encoder." + key + ".image_grid_thw"))) << key;
    const auto encoding = tokenizers::encode_qwenimage_edit_plus_prompt(
        *tokenizer, c.at("prompt").get<std::string>(), pipelines::qwen2_vl_image_token_counts(images, 2));
    EXPECT_EQ(tokenizers::qwenimage_edit_plus_text(c.at("prompt").get<std::string>(),
                                                   static_cast<int64_t>(images.size())),
              c.at("text").get<std::string>());
    const at::Tensor ids = at::tensor(encoding.input_ids, at::kLong).unsqueeze(0);
    EXPECT_TRUE(at::equal(ids, g.outputs->read("encoder." + key + ".input_ids"))) << key;
  }
}

// The VAE's input: VaeImageProcessor.preprocess(image, h, w) (LANCZOS, then [-1, 1]) is the
// Kontext preparation already here, bit for bit.
TEST(QwenImageEditPlusConditioning, GoldenVaeImageIsVaeImageProcessorPreprocess) {
  const auto& g = golden();
  ASSERT_EQ(g.cases.at("vae").size(), 2u);
  for (const auto& c : g.cases.at("vae")) {
    const std::string name = c.at("name");
    const at::Tensor source = io::read_image(g.dir + "/" + c.at("image").get<std::string>());
    const at::Tensor image =
        pipelines::kontext_condition_image(source, c.at("height").get<int64_t>(), c.at("width").get<int64_t>());
    EXPECT_TRUE(at::equal(image, g.outputs->read("vae." + name + ".image").squeeze(2))) << name;
  }
}

TEST(QwenImageEditPlusConditioning, CalculateDimensions) {
  using pipelines::qwenimage_edit_calculate_dimensions;
  EXPECT_EQ(qwenimage_edit_calculate_dimensions(384 * 384, 1.0), Size(384, 384));
  EXPECT_EQ(qwenimage_edit_calculate_dimensions(1024 * 1024, 1.0), Size(1024, 1024));
  // sqrt(147456 * 2) = 543.06: 16.97 x 32 -> 544; 271.53: 8.49 x 32 -> 256.
  EXPECT_EQ(qwenimage_edit_calculate_dimensions(384 * 384, 2.0), Size(544, 256));
  EXPECT_EQ(qwenimage_edit_calculate_dimensions(1024 * 1024, 16.0 / 9.0), Size(1376, 768));
}

TEST(Qwen2VLImageProcessor, SmartResizeBounds) {
  using pipelines::qwen2_vl_smart_resize;
  // Rounded to multiples of 28 (half to even: 42 / 28 = 1.5 -> 2), then the pixel bounds.
  EXPECT_EQ(qwen2_vl_smart_resize(42, 70, 28, 1, 1 << 30), Size(56, 56));
  EXPECT_EQ(qwen2_vl_smart_resize(20, 30, 28, 56 * 56, 1 << 30), Size(56, 84));
  const auto [h, w] = qwen2_vl_smart_resize(4000, 3000, 28, 56 * 56, 28 * 28 * 1280);
  EXPECT_LE(h * w, 28 * 28 * 1280);
  EXPECT_EQ(h % 28, 0);
  EXPECT_EQ(w % 28, 0);
  EXPECT_NE(error_of([] { qwen2_vl_smart_resize(10, 2500, 28, 1, 1 << 30); }).find("absolute aspect ratio must be smaller than 200"),
            std::string::npos);
}

TEST(Qwen2VLImageProcessor, ImagePadCountMustMatchImages) {
  EXPECT_EQ(tokenizers::expand_image_pads("a<|image_pad|>b", {2}), "a<|image_pad|><|image_pad|>b");
  EXPECT_NE(error_of([] { tokenizers::expand_image_pads("a<|image_pad|>b", {2, 3}); }).find("has 1 <|image_pad|> tokens but 2 images"),
            std::string::npos);
  EXPECT_NE(error_of([] { tokenizers::expand_image_pads("<|image_pad|><|image_pad|>", {1}); }).find("more <|image_pad|> tokens than the 1 images"),
            std::string::npos);
}

TEST(Qwen2VLImageProcessor, ConfigErrorsNameTheKey) {
  const auto parse = [](const char* text) {
    Qwen2VLImageProcessorConfig::from_json(nlohmann::json::parse(text), "preprocessor_config.json");
  };
  EXPECT_NE(error_of([&] { parse(R"({"resample": 1})"); }).find("'resample' 1 is not supported"), std::string::npos);
  EXPECT_NE(error_of([&] { parse(R"({"min_pixels": 100, "max_pixels": 50})"); }).find("'min_pixels' 100 is above"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse(R"({"image_mean": [0.5, 0.5]})"); }).find("'image_mean' must have 3 values"),
            std::string::npos);
}

}  // namespace
}  // namespace test_image_processing_qwen2_vl
}  // namespace shardit
