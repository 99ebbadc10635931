// The editing pipelines' preprocessing (pipelines/image_processor.h): Pillow's LANCZOS resize
// against the images diffusers + Pillow made (tests/golden/image_preprocess), the FLUX.2 size
// checks with diffusers' texts, FLUX.2's crop and Kontext's preferred resolutions, and
// x / 255 * 2 - 1. The whole case file also runs through the CLI (`preprocess-image --cases`).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <string>

#include "shardit/io/image.h"
#include "shardit/pipelines/image_processor.h"
#include "shardit/pipelines/pipeline_qwenimage_edit_plus.h"
#include "support/sha256.h"
#include "support/test_support.h"

namespace shardit {
namespace test_image_processor {
namespace {

using testing::error_of;
using testing::golden_path;

/// Max |a - b| in 8-bit levels, and how many values differ.
std::pair<int, int64_t> level_difference(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor difference = (a.to(at::kInt) - b.to(at::kInt)).abs();
  return {difference.max().item<int>(), difference.gt(0).sum().item<int64_t>()};
}

// Pillow's Image.resize(LANCZOS) of the golden sources, compared directly with the expected PNGs
// (the processed tensors as 8-bit images): downscale (FLUX.2's 1024² area, then the crop) and
// upscale (Kontext's preferred resolution). Within one 8-bit level on every value, as the case
// file allows; the count of values that differ at all is printed.
TEST(ResizeLanczos, GoldenMatchesPillowWithinOneLevel) {
  const std::string dir = golden_path("image_preprocess");
  {
    const at::Tensor source = io::read_image(dir + "/source_big.png");  // 1000 x 1100
    const double scale = std::sqrt(1024.0 * 1024.0 / (1100.0 * 1000.0));
    const auto width = static_cast<int64_t>(1100 * scale);
    const auto height = static_cast<int64_t>(1000 * scale);
    const at::Tensor resized = pipelines::resize_lanczos(source, height, width);
    ASSERT_EQ(resized.sizes(), (std::vector<int64_t>{height, width, 3}));
    const at::Tensor expected = io::read_image(dir + "/expected_flux2_big.png");  // 976 x 1072
    const at::Tensor cropped = resized.narrow(0, (height - expected.size(0)) / 2, expected.size(0))
                                   .narrow(1, (width - expected.size(1)) / 2, expected.size(1));
    const auto [largest, differing] = level_difference(cropped, expected);
    std::cout << "  downscale " << source.sizes() << " -> " << resized.sizes() << ": max " << largest << " level(s), "
              << differing << " of " << cropped.numel() << " values differ\n";
    EXPECT_LE(largest, 1);
  }
  for (const std::string source_name : {"kontext", "crop"}) {
    const at::Tensor source = io::read_image(dir + "/source_" + source_name + ".png");
    const at::Tensor expected = io::read_image(dir + "/expected_kontext_" + source_name + ".png");
    const at::Tensor resized = pipelines::resize_lanczos(source, expected.size(0), expected.size(1));
    const auto [largest, differing] = level_difference(resized, expected);
    std::cout << "  upscale " << source.sizes() << " -> " << resized.sizes() << ": max " << largest << " level(s), "
              << differing << " of " << resized.numel() << " values differ\n";
    EXPECT_LE(largest, 1);
  }
}

TEST(ResizeLanczos, SameSizeIsACopyAndOneAxisResizesOnlyThatAxis) {
  const at::Tensor pixels = at::randint(0, 256, {5, 7, 3}, at::kByte);
  const at::Tensor same = pipelines::resize_lanczos(pixels, 5, 7);
  EXPECT_TRUE(at::equal(same, pixels));
  EXPECT_NE(same.data_ptr(), pixels.data_ptr());
  // A flat image stays flat under any resize (the coefficients sum to 1 in fixed point).
  const at::Tensor flat = at::full({9, 13, 3}, 117, at::kByte);
  EXPECT_TRUE(at::equal(pipelines::resize_lanczos(flat, 4, 29), at::full({4, 29, 3}, 117, at::kByte)));
  // Rows resized alone keep each column's own values: columns of a vertical stripe pattern.
  const at::Tensor stripes = (at::arange(6, at::kInt) * 40).to(at::kByte).view({1, 6, 1}).expand({8, 6, 3}).contiguous();
  EXPECT_TRUE(at::equal(pipelines::resize_lanczos(stripes, 3, 6), stripes.narrow(0, 0, 3)));
}

TEST(ImageProcessorErrors, Flux2SizeChecksUseDiffusersTexts) {
  EXPECT_EQ(error_of([] { pipelines::check_flux2_image_input(50, 200); }),
            "Image too small: 200\u00d750. Both dimensions must be at least 64px");
  EXPECT_EQ(error_of([] { pipelines::check_flux2_image_input(64, 600); }),
            "Aspect ratio too extreme: 600\u00d764 (ratio: 9.4:1). Maximum allowed ratio is 8:1");
  EXPECT_NO_THROW(pipelines::check_flux2_image_input(64, 512));  // exactly 8:1
  EXPECT_NE(error_of([] { pipelines::resize_lanczos(at::zeros({4, 4, 3}, at::kFloat), 2, 2); }).find("uint8 [H, W, 3]"),
            std::string::npos);
}

TEST(ImageProcessor, Flux2CropsToMultiplesOf16AroundTheCentre) {
  // 100 x 70 -> 96 x 64, the crop starting at (2, 3); values x / 255 * 2 - 1 exactly.
  const at::Tensor pixels = at::randint(0, 256, {100, 70, 3}, at::kByte);
  const at::Tensor input = pipelines::flux2_condition_image(pixels);
  ASSERT_EQ(input.sizes(), (std::vector<int64_t>{1, 3, 96, 64}));
  const at::Tensor crop = pixels.narrow(0, 2, 96).narrow(1, 3, 64).permute({2, 0, 1}).unsqueeze(0).to(at::kFloat);
  EXPECT_TRUE(at::equal(input, crop / 255.0f * 2.0f - 1.0f) || at::allclose(input, crop / 255.0 * 2.0 - 1.0, 0, 1e-7));
  EXPECT_EQ(pipelines::pixels_to_model_input(at::full({1, 1, 3}, 255, at::kByte)).min().item<float>(), 1.0f);
  EXPECT_EQ(pipelines::pixels_to_model_input(at::zeros({1, 1, 3}, at::kByte)).max().item<float>(), -1.0f);
}

TEST(ImageProcessor, KontextSizesFollowThePreferredResolutions) {
  EXPECT_EQ(pipelines::preferred_kontext_resolutions().size(), 17u);
  EXPECT_EQ(pipelines::kontext_image_size(200, 300, true), std::make_pair(int64_t{832}, int64_t{1248}));
  EXPECT_EQ(pipelines::kontext_image_size(100, 70, true), std::make_pair(int64_t{1248}, int64_t{832}));
  EXPECT_EQ(pipelines::kontext_image_size(512, 512, true), std::make_pair(int64_t{1024}, int64_t{1024}));
  // Without auto-resize: the image's own size floored to multiples of 16.
  EXPECT_EQ(pipelines::kontext_image_size(100, 70, false), std::make_pair(int64_t{96}, int64_t{64}));
  EXPECT_NE(error_of([] { pipelines::kontext_image_size(10, 300, true); }).find("smaller than 16 pixels"),
            std::string::npos);
}

// The whole image_preprocess case file through the CLI: every case passes (resized ones within
// one level, cropped ones exactly, the error cases with diffusers' exact texts).
TEST(PreprocessImageCli, GoldenCasesFilePasses) {
  const std::string cases = golden_path("image_preprocess") + "/case.json";
  std::string output;
  const int status = testing::run_command(testing::cli_path() + " preprocess-image --cases '" + cases + "'", &output);
  std::cout << output;
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find(": 7 passed, 0 failed"), std::string::npos) << output;
}

TEST(PreprocessImageCli, GoldenWritesTheProcessedImageAndNeverOverTheInput) {
  const std::string source = golden_path("image_preprocess") + "/source_crop.png";
  const std::string out = testing::make_temp_dir("preprocess_image") + "/out.png";
  std::string output;
  ASSERT_EQ(testing::run_command(testing::cli_path() + " preprocess-image --image '" + source +
                                     "' --pipeline flux2 --out '" + out + "'",
                                 &output),
            0)
      << output;
  EXPECT_TRUE(at::equal(io::read_image(out), io::read_image(golden_path("image_preprocess") + "/expected_flux2_crop.png")));
  // The input as output is refused before anything is written.
  const std::string copy = testing::make_temp_dir("preprocess_image_in") + "/in.png";
  {
    std::ifstream in(source, std::ios::binary);
    std::ofstream(copy, std::ios::binary) << in.rdbuf();
  }
  const int status = testing::run_command(
      testing::cli_path() + " preprocess-image --image '" + copy + "' --pipeline kontext --out '" + copy + "'", &output);
  EXPECT_NE(status, 0) << output;
  EXPECT_TRUE(at::equal(io::read_image(copy), io::read_image(source)));
}

// `--pipeline qwenimage-edit`: the VAE's image at the area's calculate_dimensions (the pipeline's
// own preparation) and the 384² condition image diffusers gave the processor (its pixels' SHA-256
// in the golden encoder case with three images, whose third is source_big.png).
TEST(PreprocessImageCli, GoldenQwenImageEditWritesTheVaeAndConditionImages) {
  const std::string dir = golden_path("edit_qwenimage");
  const std::string out = testing::make_temp_dir("preprocess_qwen_edit") + "/big.png";
  std::string output;
  ASSERT_EQ(testing::run_command(testing::cli_path() + " preprocess-image --pipeline qwenimage-edit --max-area 2304 "
                                     "--image '" + dir + "/source_big.png' --out '" + out + "'",
                                 &output),
            0)
      << output;
  EXPECT_NE(output.find("VAE input of 32x64"), std::string::npos) << output;
  const at::Tensor source = io::read_image(dir + "/source_big.png");
  const pipelines::QwenImageEditImage expected = pipelines::qwenimage_edit_plus_image(source, 2304);
  EXPECT_TRUE(at::equal(io::read_image(out), io::to_uint8_pixels((expected.vae_input[0].permute({1, 2, 0}) + 1) / 2)));
  const at::Tensor condition = io::read_image(out.substr(0, out.size() - 4) + ".condition.png");
  const nlohmann::json case_json = nlohmann::json::parse(std::ifstream(dir + "/case.json"));
  for (const auto& entry : case_json.at("encoder")) {
    if (entry.at("name") != "three") continue;
    ASSERT_EQ(entry.at("images").at(2), "source_big.png");
    const auto& size = entry.at("condition_sizes").at(2);
    EXPECT_EQ(condition.size(0), size.at("height").get<int64_t>());
    EXPECT_EQ(condition.size(1), size.at("width").get<int64_t>());
    EXPECT_EQ(testing::sha256_hex(condition.contiguous().data_ptr(), static_cast<size_t>(condition.numel())),
              size.at("pixels_sha256").get<std::string>());
  }
}

}  // namespace
}  // namespace test_image_processor
}  // namespace shardit
