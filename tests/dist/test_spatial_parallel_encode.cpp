// The parallel VAE encode in real multi-process groups: each rank encodes a band of the image's
// rows (bands start at multiples of the encoder's downsampling factor; each stride-2
// Downsample2D reads the first row of the band below, 3x3 convolutions exchange halo rows,
// GroupNorm statistics and mid-block attention span the group) and the gathered mode equals the
// single-rank encode of the same process. FLUX.1's, FLUX.2's and Qwen-Image's VAEs, 2 and 3
// ranks, heights that the degree does not divide and that are not multiples of the factor; the
// errors.
#include <gtest/gtest.h>

#include <iostream>
#include <memory>
#include <string>

#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/models/vae/vae.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_spatial_parallel_encode {
namespace {

using shardit::testing::error_of;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::load_golden_vae;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;

// The parallel encode changes only the order of summation in the GroupNorm statistics (sums of
// bands) and of the attention's softmax over gathered keys; a wrong halo or band alignment
// gives O(1) errors in whole latent rows. Float rounding of those sums: at most 4.2e-6 measured
// (mode magnitudes below 1) on 2 and 3 ranks.
constexpr double kTol = 1e-5;

at::Tensor random_image(std::vector<int64_t> shape, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::rand(shape, generator) * 2 - 1;
}

/// Encodes `image` alone, then over the world by row bands; expects the same mode on every rank.
void expect_parallel_equals_single(shardit::models::AutoencoderModel& vae, const at::Tensor& image,
                                   const std::string& what) {
  shardit::dist::World& world = shardit::dist::World::get();
  const at::Tensor single = vae.encode(image);
  vae.enable_parallel_decode(world.group());
  const at::Tensor parallel = vae.encode(image);
  vae.disable_parallel_decode();
  const auto result =
      tensors_close(what + " on " + std::to_string(world.size()) + " ranks", parallel, single, kTol, kTol);
  EXPECT_TRUE(result);
  if (world.rank() == 0) std::cout << "  " << result.message() << "\n";
}

class SpatialParallelGoldenEncode : public ::testing::TestWithParam<int> {};

TEST_P(SpatialParallelGoldenEncode, EncodeEqualsSingleRankAndDiffusers) {
  if (is_worker()) {
    shardit::dist::World::init();
    const std::vector<std::pair<std::string, std::string>> cases = {{"pipeline_flux1", "edit_flux1_kontext"},
                                                                     {"pipeline_flux2_klein", "edit_flux2_klein"},
                                                                     {"pipeline_flux2_dev", "edit_flux2_dev"}};
    for (const auto& [pipeline, edit] : cases) {
      auto vae = load_golden_vae(pipeline);
      const auto outputs = shardit::io::SafetensorsFile::open(golden_path(edit) + "/outputs.safetensors");
      const at::Tensor input = outputs->read("refs_a.vae_encode.0.input");  // 64 x 96: 8 latent rows
      expect_parallel_equals_single(*vae, input, pipeline + " golden input");
      vae->enable_parallel_decode(shardit::dist::World::get().group());
      EXPECT_TRUE(tensors_close(pipeline + " parallel vs diffusers", vae->encode(input),
                                outputs->read("refs_a.vae_encode.0.mode"), 1e-4, 1e-4));
      vae->disable_parallel_decode();
      // Uneven bands, batch 2, and rows beyond the last whole latent row (the last band takes
      // them; the encoder floors them away as on one rank): 8 x 7 + 5 rows.
      expect_parallel_equals_single(*vae, random_image({2, 3, 61, 40}, 3), pipeline + " 61x40");
      // One latent row per rank.
      const int64_t degree = shardit::dist::World::get().size();
      expect_parallel_equals_single(*vae, random_image({1, 3, 8 * degree, 24}, 4), pipeline + " one row each");
    }
    return;
  }
  EXPECT_EQ(run_ranks(GetParam()), 0);
}

// Qwen-Image's VAE (causal 3-D convolutions on one frame, stride-2 resamplers reading the first
// row of the band below, RMS norms per pixel, mid-block attention over the gathered keys): the
// parallel encode equals the single-rank one, and the normalised latents diffusers'
// _encode_vae_image gave (tests/golden/edit_qwenimage), for both golden images as the pipeline
// passes them ([1, 3, 1, H, W]: the bands cut the rows, dimension 3) and as [B, 3, H, W].
TEST_P(SpatialParallelGoldenEncode, QwenImageEncodeEqualsSingleRankAndDiffusers) {
  if (is_worker()) {
    shardit::dist::World::init();
    auto vae = load_golden_vae("edit_qwenimage");
    const auto outputs = shardit::io::SafetensorsFile::open(golden_path("edit_qwenimage") + "/outputs.safetensors");
    for (const std::string name : {"wide", "tall"}) {  // 32 x 48 and 48 x 32: 4 and 6 latent rows
      const at::Tensor input = outputs->read("vae." + name + ".image");  // [1, 3, 1, H, W]
      expect_parallel_equals_single(*vae, input, "Qwen-Image golden " + name);
      expect_parallel_equals_single(*vae, input.squeeze(2), "Qwen-Image golden " + name + " as [B, 3, H, W]");
      vae->enable_parallel_decode(shardit::dist::World::get().group());
      EXPECT_TRUE(tensors_close("Qwen-Image parallel vs diffusers " + name, vae->normalize_latents(vae->encode(input)),
                                outputs->read("vae." + name + ".image_latents"), 1e-4, 1e-4));
      vae->disable_parallel_decode();
    }
    expect_parallel_equals_single(*vae, random_image({2, 3, 1, 61, 40}, 3), "Qwen-Image 61x40");
    const int64_t degree = shardit::dist::World::get().size();
    expect_parallel_equals_single(*vae, random_image({1, 3, 8 * degree, 24}, 4), "Qwen-Image one row each");
    return;
  }
  EXPECT_EQ(run_ranks(GetParam()), 0);
}

TEST_P(SpatialParallelGoldenEncode, TooFewRowsAndTilingAreRefusedOnEveryRank) {
  if (is_worker()) {
    shardit::dist::World::init();
    const int64_t degree = shardit::dist::World::get().size();
    auto vae = load_golden_vae("pipeline_flux2_klein");
    vae->enable_parallel_decode(shardit::dist::World::get().group());
    const std::string message = error_of([&] { vae->encode(random_image({1, 3, 8 * (degree - 1) + 7, 16}, 1)); });
    EXPECT_NE(message.find("too few to encode over " + std::to_string(degree) + " ranks"), std::string::npos) << message;
    EXPECT_NE(message.find("the largest degree that works for this height is " + std::to_string(degree - 1)),
              std::string::npos)
        << message;
    vae->enable_tiling();
    const std::string tiling = error_of([&] { vae->encode(random_image({1, 3, 64, 64}, 1)); });
    EXPECT_NE(tiling.find("tiled encoding and a parallel encode"), std::string::npos) << tiling;
    // The group still works after the refusals.
    vae->disable_tiling();
    vae->disable_parallel_decode();
    expect_parallel_equals_single(*vae, random_image({1, 3, 8 * degree, 16}, 2), "after errors");
    // Qwen-Image's VAE, its rows in dimension 3 of [B, 3, 1, H, W]; more than one frame.
    auto qwen = load_golden_vae("edit_qwenimage");
    qwen->enable_parallel_decode(shardit::dist::World::get().group());
    const std::string rows = error_of([&] { qwen->encode(random_image({1, 3, 1, 8 * (degree - 1) + 7, 16}, 1)); });
    EXPECT_NE(rows.find("AutoencoderKLQwenImage: an image of " + std::to_string(8 * (degree - 1) + 7) + " rows"),
              std::string::npos)
        << rows;
    EXPECT_NE(rows.find("too few to encode over " + std::to_string(degree) + " ranks"), std::string::npos) << rows;
    EXPECT_NE(rows.find("the largest degree that works for this height is " + std::to_string(degree - 1)),
              std::string::npos)
        << rows;
    const std::string frames = error_of([&] { qwen->encode(random_image({1, 3, 2, 8 * degree, 16}, 1)); });
    EXPECT_NE(frames.find("2 frames; only one frame"), std::string::npos) << frames;
    qwen->disable_parallel_decode();
    expect_parallel_equals_single(*qwen, random_image({1, 3, 1, 8 * degree, 16}, 2), "Qwen-Image after errors");
    return;
  }
  EXPECT_EQ(run_ranks(GetParam()), 0);
}

INSTANTIATE_TEST_SUITE_P(Degrees, SpatialParallelGoldenEncode, ::testing::Values(2, 3));

}  // namespace
}  // namespace test_spatial_parallel_encode
