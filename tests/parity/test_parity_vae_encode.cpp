// The VAE encoders (AutoencoderKL for FLUX.1 Kontext, AutoencoderKLFlux2 for FLUX.2 [klein] and
// [dev], AutoencoderKLQwenImage for Qwen-Image editing) against diffusers' golden editing runs:
// every vae.encode call of every run, the processed image in, the posterior's mode out, through
// the real load path of the pipeline folders' vae/ (encoder weights included). Tolerance 1e-4 +
// 1e-4|mode| (the golden README's VAE tolerance: the reference's own 1- vs 2-thread spread is a
// few 1e-6). Then tiled encoding on a small tile, normalize_latents against the pipelines'
// formulas, Qwen-Image's encoder in bf16, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardit/io/image.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/models/vae/autoencoder_kl.h"
#include "shardit/models/vae/autoencoder_kl_flux2.h"
#include "shardit/models/vae/autoencoder_kl_qwenimage.h"
#include "shardit/models/vae/vae.h"
#include "shardit/pipelines/image_processor.h"
#include "support/test_support.h"
#include "support/tiled_reference.h"

namespace shardit {
namespace test_parity_vae_encode {
namespace {

using testing::error_of;
using testing::golden_path;
using testing::load_golden_vae;
using testing::reference_tiled_decode;
using testing::tensors_close;

constexpr double kTol = 1e-4;

struct EncodeCase {
  std::string edit;      ///< the golden editing case
  std::string pipeline;  ///< the folder whose vae/ it used
};

std::ostream& operator<<(std::ostream& out, const EncodeCase& c) { return out << c.edit; }

nlohmann::json read_case(const std::string& edit) {
  std::ifstream in(golden_path(edit) + "/case.json");
  return nlohmann::json::parse(in);
}

/// The tile settings of either encoder-bearing VAE.
models::AutoencoderKLTiling& tiling_of(models::AutoencoderModel& vae) {
  if (auto* kl = dynamic_cast<models::AutoencoderKL*>(&vae)) return kl->tiling;
  auto* flux2 = dynamic_cast<models::AutoencoderKLFlux2*>(&vae);
  TORCH_INTERNAL_ASSERT(flux2 != nullptr, vae.type_name(), " has no tiling settings");
  return flux2->tiling;
}

class VaeEncodeParity : public ::testing::TestWithParam<EncodeCase> {};

TEST_P(VaeEncodeParity, GoldenModeOfEveryEncoderCallMatchesDiffusers) {
  auto vae = load_golden_vae(GetParam().pipeline);
  ASSERT_TRUE(vae->has_encoder());
  const nlohmann::json config = read_case(GetParam().edit);
  const auto outputs = io::SafetensorsFile::open(golden_path(GetParam().edit) + "/outputs.safetensors");
  int compared = 0;
  for (const auto& run : config.at("runs")) {
    const std::string tag = run.at("tag").get<std::string>();
    for (int k = 0; k < run.at("encoder_calls").get<int>(); ++k) {
      const std::string prefix = tag + ".vae_encode." + std::to_string(k);
      const at::Tensor input = outputs->read(prefix + ".input");
      const at::Tensor mode = outputs->read(prefix + ".mode");
      const at::Tensor z = vae->encode(input);
      const auto result = tensors_close(GetParam().edit + " " + prefix + ".mode", z, mode, kTol, kTol);
      EXPECT_TRUE(result);
      std::cout << "  compared " << result.message() << "\n";
      ++compared;
    }
  }
  EXPECT_GE(compared, 1);
}

// The golden reference PNGs through the pipelines' preprocessing give exactly the tensors
// diffusers encoded: FLUX.2's Flux2ImageProcessor path; Kontext's with _auto_resize=False (as the
// golden runs call it), the size floored to multiples of 16 and no resampling.
TEST_P(VaeEncodeParity, GoldenReferencePngsPreprocessToTheEncodedInputsExactly) {
  const nlohmann::json config = read_case(GetParam().edit);
  const std::string dir = golden_path(GetParam().edit);
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  const bool kontext = GetParam().edit == "edit_flux1_kontext";
  int compared = 0;
  for (const auto& run : config.at("runs")) {
    const std::string tag = run.at("tag").get<std::string>();
    const auto references = run.at("references").get<std::vector<std::string>>();
    ASSERT_EQ(static_cast<int>(references.size()), run.at("encoder_calls").get<int>());
    for (size_t k = 0; k < references.size(); ++k) {
      const at::Tensor pixels = io::read_image(dir + "/" + references[k]);
      at::Tensor input;
      if (kontext) {
        const auto [height, width] = pipelines::kontext_image_size(pixels.size(0), pixels.size(1), false);
        input = pipelines::kontext_condition_image(pixels, height, width);
      } else {
        input = pipelines::flux2_condition_image(pixels);
      }
      const std::string name = tag + ".vae_encode." + std::to_string(k) + ".input";
      EXPECT_TRUE(tensors_close(GetParam().edit + " " + name, input, outputs->read(name), 0, 0));
      ++compared;
    }
  }
  EXPECT_GE(compared, 1);
}

/// diffusers' _tiled_encode through the test's transcription of the tile loop, with the grid
/// written from its formulas here (tiles of `tile` pixels every int(tile * 0.75), latents
/// blended over int(latent_tile * 0.25), latent_tile minus that kept), each tile through the
/// encoder and quant_conv; then the mean half of the moments.
at::Tensor reference_tiled_mode(models::AutoencoderModel& vae, const at::Tensor& x, int64_t tile, int64_t latent_tile) {
  models::Encoder* encoder = nullptr;
  nn::Conv2d* quant_conv = nullptr;
  if (auto* kl = dynamic_cast<models::AutoencoderKL*>(&vae)) {
    encoder = kl->encoder.get();
    quant_conv = kl->quant_conv.get();
  } else {
    auto& flux2 = dynamic_cast<models::AutoencoderKLFlux2&>(vae);
    encoder = flux2.encoder.get();
    quant_conv = flux2.quant_conv.get();
  }
  models::TileGrid grid;
  grid.tile_latent_height = grid.tile_latent_width = tile;
  grid.latent_stride_height = grid.latent_stride_width = static_cast<int64_t>(static_cast<double>(tile) * 0.75);
  grid.blend_height = grid.blend_width = static_cast<int64_t>(static_cast<double>(latent_tile) * 0.25);
  grid.keep_height = grid.keep_width = latent_tile - grid.blend_height;
  const at::Tensor moments = reference_tiled_decode(x, grid, [&](const at::Tensor& piece) {
    const at::Tensor out = encoder->forward(piece);
    return quant_conv != nullptr ? quant_conv->forward(out) : out;
  });
  return moments.narrow(1, 0, moments.size(1) / 2);
}

// Tiles of 32 pixels (4 latent rows at 8x) over the 64x96 golden input: 3x4 tiles blended over
// one latent row/column. Tiling changes the numbers (each tile has its own GroupNorm statistics
// and receptive field, as in diffusers: with these tiny random VAEs the tiled mode is far from
// the untiled one), so the check is the shape, finiteness, and equality with diffusers' tile loop
// transcribed in the test (float rounding of the same sums: 1e-6).
TEST_P(VaeEncodeParity, GoldenTiledEncodeOnASmallTileFollowsDiffusersTileLoop) {
  auto vae = load_golden_vae(GetParam().pipeline);
  const auto outputs = io::SafetensorsFile::open(golden_path(GetParam().edit) + "/outputs.safetensors");
  const at::Tensor input = outputs->read("refs_a.vae_encode.0.input");
  const at::Tensor untiled = vae->encode(input);
  models::AutoencoderKLTiling& tiling = tiling_of(*vae);
  tiling.tile_sample_min_size = 32;
  tiling.tile_latent_min_size = 32 / vae->vae_scale_factor();
  vae->enable_tiling();
  const at::Tensor tiled = vae->encode(input);
  ASSERT_EQ(tiled.sizes(), untiled.sizes());
  EXPECT_TRUE(at::isfinite(tiled).all().item<bool>());
  EXPECT_FALSE(at::equal(tiled, untiled)) << "tiling did not apply";
  EXPECT_TRUE(tensors_close(GetParam().edit + " tiled mode vs diffusers' tile loop", tiled,
                            reference_tiled_mode(*vae, input, 32, 4), 1e-6, 1e-6));
  const double mean_difference = (tiled - untiled).abs().mean().item<double>();
  std::cout << "  tiled vs untiled: mean |diff| " << mean_difference << ", mean |mode| "
            << untiled.abs().mean().item<double>() << "\n";
  // 52 rows in 32-pixel tiles every 24 rows leave an edge tile of 4 rows (48..51), fewer than
  // the encoder's 8-pixel downsampling: refused by name.
  const std::string message = error_of([&] { vae->encode(at::zeros({1, 3, 52, 32})); });
  EXPECT_NE(message.find("tiled encode: a tile of 4x32 pixels"), std::string::npos) << message;
  // An image within one tile is encoded untiled, as in diffusers.
  tiling.tile_sample_min_size = 96;
  tiling.tile_latent_min_size = 96 / vae->vae_scale_factor();
  EXPECT_TRUE(at::equal(vae->encode(input), untiled));
}

// normalize_latents is the inverse of denormalize_latents (the pipelines' own formulas).
TEST_P(VaeEncodeParity, GoldenNormalizeLatentsInvertsDenormalize) {
  auto vae = load_golden_vae(GetParam().pipeline);
  const auto outputs = io::SafetensorsFile::open(golden_path(GetParam().edit) + "/outputs.safetensors");
  const at::Tensor mode = outputs->read("refs_a.vae_encode.0.mode");
  const at::Tensor normalized = vae->normalize_latents(mode);
  if (vae->type_name() == "AutoencoderKLFlux2") {
    EXPECT_EQ(normalized.sizes(), (std::vector<int64_t>{1, mode.size(1) * 4, mode.size(2) / 2, mode.size(3) / 2}));
  } else {
    const auto& config = dynamic_cast<models::AutoencoderKL&>(*vae).config();
    EXPECT_TRUE(tensors_close("(z - shift) * scale", normalized,
                              (mode - config.shift_factor.value_or(0.0)) * config.scaling_factor, 0, 0));
  }
  EXPECT_TRUE(tensors_close(GetParam().edit + " denormalize(normalize(z))", vae->denormalize_latents(normalized), mode,
                            1e-5, 1e-5));
}

TEST_P(VaeEncodeParity, GoldenBadImagesAreNamedErrors) {
  auto vae = load_golden_vae(GetParam().pipeline);
  const std::string name = vae->type_name();
  std::string message = error_of([&] { vae->encode(at::zeros({1, 4, 64, 64})); });
  EXPECT_NE(message.find(name + ": image has shape [1, 4, 64, 64], expected [B, 3, H, W]"), std::string::npos) << message;
  message = error_of([&] { vae->encode(at::zeros({3, 64, 64})); });
  EXPECT_NE(message.find("expected [B, C, H, W]"), std::string::npos) << message;
  message = error_of([&] { vae->encode(at::zeros({1, 3, 4, 64})); });
  EXPECT_NE(message.find("sides of at least 8 pixels"), std::string::npos) << message;
  at::Tensor bad = at::zeros({1, 3, 16, 16});
  bad[0][1][2][3] = std::nan("");
  message = error_of([&] { vae->encode(bad); });
  EXPECT_NE(message.find("non-finite"), std::string::npos) << message;
  if (name == "AutoencoderKLFlux2") {
    message = error_of([&] { vae->normalize_latents(at::zeros({1, vae->latent_channels(), 3, 4})); });
    EXPECT_NE(message.find("even height and width"), std::string::npos) << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, VaeEncodeParity,
                         ::testing::Values(EncodeCase{"edit_flux2_klein", "pipeline_flux2_klein"},
                                           EncodeCase{"edit_flux2_dev", "pipeline_flux2_dev"},
                                           EncodeCase{"edit_flux1_kontext", "pipeline_flux1"}),
                         [](const auto& info) { return info.param.edit; });

// Qwen-Image's VAE encoder (causal 3-D convolutions on one frame) against diffusers'
// QwenImageEditPlusPipeline._encode_vae_image (tests/golden/edit_qwenimage): the posterior's mode,
// normalised with latents_mean / latents_std. fp32 within the golden set's VAE tolerance
// (1e-4 + 1e-4 |expected|).
TEST(VaeEncodeQwenImage, GoldenEncodeVaeImageMatchesDiffusers) {
  auto vae = load_golden_vae("edit_qwenimage");
  ASSERT_TRUE(vae->has_encoder());
  const auto outputs = io::SafetensorsFile::open(golden_path("edit_qwenimage") + "/outputs.safetensors");
  int compared = 0;
  for (const std::string name : {"wide", "tall"}) {
    const at::Tensor image = outputs->read("vae." + name + ".image");  // [1, 3, 1, H, W]
    const at::Tensor expected = outputs->read("vae." + name + ".image_latents");
    // The pipeline's own input, one frame [1, 3, 1, H, W]; the same image as [1, 3, H, W] gives
    // the same bits.
    const at::Tensor z = vae->encode(image);
    ASSERT_EQ(z.sizes(), (std::vector<int64_t>{1, vae->latent_channels(), 1, image.size(3) / 8, image.size(4) / 8}));
    EXPECT_TRUE(at::equal(vae->encode(image.squeeze(2)), z)) << name << ": 4-D and 5-D inputs differ";
    const at::Tensor latents = vae->normalize_latents(z);
    std::cout << name << ": max |diff| " << (latents - expected).abs().max().item<double>() << " of max |expected| "
              << expected.abs().max().item<double>() << "\n";
    EXPECT_TRUE(tensors_close("vae." + name + ".image_latents", latents, expected, 1e-4, 1e-4));
    ++compared;
  }
  EXPECT_EQ(compared, 2);
}

// bf16 weights and activations (the RMS norms in fp32, as the reference) against the fp32
// golden latents (|latents| up to 0.59): bf16 rounds to 8 mantissa bits (4e-3 relative per
// rounding) through the encoder's convolutions; measured at most 9.1e-3 off (wide 7.8e-3, tall
// 9.1e-3). Bound 3e-2 + 3e-2 |latents| (the parallel bf16 decode's bound), about 3x the
// measured error.
TEST(VaeEncodeQwenImage, GoldenBf16EncodeIsWithinTheMeasuredBound) {
  auto vae = load_golden_vae("edit_qwenimage");
  vae->to(at::kCPU, at::kBFloat16);
  const auto outputs = io::SafetensorsFile::open(golden_path("edit_qwenimage") + "/outputs.safetensors");
  for (const std::string name : {"wide", "tall"}) {
    const at::Tensor z = vae->encode(outputs->read("vae." + name + ".image").to(at::kBFloat16));
    ASSERT_EQ(z.scalar_type(), at::kBFloat16);
    const at::Tensor latents = vae->normalize_latents(z).to(at::kFloat);
    const at::Tensor expected = outputs->read("vae." + name + ".image_latents");
    std::cout << name << " bf16: max |diff| " << (latents - expected).abs().max().item<double>()
              << ", max |diff| / (1 + |expected|) "
              << ((latents - expected).abs() / (expected.abs() + 1)).max().item<double>() << "\n";
    EXPECT_TRUE(tensors_close("bf16 vae." + name + ".image_latents", latents, expected, 3e-2, 3e-2));
  }
}

TEST(VaeEncodeQwenImage, BadShapesAreNamed) {
  auto vae = load_golden_vae("edit_qwenimage");
  std::string message = error_of([&] { vae->encode(at::zeros({1, 4, 32, 32})); });
  EXPECT_NE(message.find("AutoencoderKLQwenImage: image has shape"), std::string::npos) << message;
  message = error_of([&] { vae->encode(at::zeros({1, 4, 1, 32, 32})); });
  EXPECT_NE(message.find("AutoencoderKLQwenImage: image has shape [1, 4, 1, 32, 32]"), std::string::npos) << message;
  // A video: more than one frame is refused by name.
  message = error_of([&] { vae->encode(at::zeros({1, 3, 2, 32, 32})); });
  EXPECT_NE(message.find("2 frames; only one frame [B, C, 1, H, W] (an image) is encoded"), std::string::npos)
      << message;
  message = error_of([&] { vae->encode(at::zeros({1, 1, 3, 1, 32, 32})); });
  EXPECT_NE(message.find("expected [B, C, H, W] (or one frame [B, C, 1, H, W]"), std::string::npos) << message;
}

// Tiles of 32 pixels every 24 over a 48x72 image (2x3 tiles, latents blended over one row and
// column): the tiled mean equals diffusers' tile loop transcribed in the test, run on the
// untiled encode of each tile (blending is linear, so blending means equals blending moments);
// float rounding of the same sums only.
TEST(VaeEncodeQwenImage, TiledEncodeFollowsDiffusersTileLoop) {
  auto vae = load_golden_vae("edit_qwenimage");
  auto* qwen = dynamic_cast<models::AutoencoderKLQwenImage*>(vae.get());
  ASSERT_NE(qwen, nullptr);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor image = at::rand({1, 3, 48, 72}, generator) * 2 - 1;
  const at::Tensor untiled = vae->encode(image);
  qwen->enable_tiling(32, 32, 24, 24);
  const at::Tensor tiled = vae->encode(image);
  ASSERT_EQ(tiled.sizes(), untiled.sizes());
  EXPECT_FALSE(at::equal(tiled, untiled)) << "tiling did not apply";
  vae->disable_tiling();
  // The reference loop blends [B, C, h, w] tiles: the one frame's dimension is dropped.
  const at::Tensor reference = testing::reference_tiled_decode(
      image, qwen->encode_tile_grid(48, 72), [&](const at::Tensor& tile) { return vae->encode(tile).squeeze(2); });
  EXPECT_TRUE(
      tensors_close("Qwen-Image tiled mean vs diffusers' tile loop", tiled.squeeze(2), reference, 1e-6, 1e-6));
  // 52 rows in 32-pixel tiles every 24 leave an edge tile of 4 rows (48..51), fewer than the
  // encoder's 8-pixel downsampling: refused by name, with the settings to change.
  qwen->enable_tiling(32, 32, 24, 24);
  const std::string message = error_of([&] { vae->encode(at::zeros({1, 3, 1, 52, 32})); });
  EXPECT_NE(message.find("AutoencoderKLQwenImage: tiled encode: a tile of 4x32 pixels"), std::string::npos) << message;
  EXPECT_NE(message.find("8-pixel downsampling"), std::string::npos) << message;
  EXPECT_NE(message.find("tile_sample_min_height 32"), std::string::npos) << message;
}

}  // namespace
}  // namespace test_parity_vae_encode
}  // namespace shardit
