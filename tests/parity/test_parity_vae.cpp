// The three VAE decoders against diffusers' golden cases (vae_flux1, vae_flux2, vae_qwenimage)
// through the real load path: the pipeline's de-normalisation (z), every decoder intermediate
// and the sample, tolerance 1e-4 + 1e-4|b| (golden README: the reference's own 1- vs 2-thread
// spread is <= 2.8e-6). Then tiled decoding: equal to the untiled decode where diffusers' is
// (latents within one tile), equal to a literal transcription of diffusers' tile loop
// otherwise, and never handing the decoder more than one tile.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/models/vae/autoencoder_kl.h"
#include "shardit/models/vae/autoencoder_kl_flux2.h"
#include "shardit/models/vae/autoencoder_kl_qwenimage.h"
#include "shardit/models/vae/vae.h"
#include "shardit/nn/module.h"
#include "support/test_support.h"
#include "support/tiled_reference.h"

namespace shardit {
namespace test_parity_vae {
namespace {

using testing::golden_path;
using testing::reference_tiled_decode;
using testing::tensors_close;

constexpr double kTol = 1e-4;

std::shared_ptr<models::AutoencoderModel> load_vae(const std::string& case_name) {
  const io::ComponentFolder folder = io::open_component(golden_path(case_name), "vae");
  auto vae = models::create_vae(folder);
  vae->load(folder.weights(), {});
  return vae;
}

class VaeParity : public ::testing::TestWithParam<std::string> {};

TEST_P(VaeParity, SampleAndEveryIntermediateMatchDiffusers) {
  const std::string dir = golden_path(GetParam());
  auto vae = load_vae(GetParam());
  const auto inputs = io::SafetensorsFile::open(dir + "/inputs.safetensors");

  std::map<std::string, at::Tensor> recorded;
  const std::string latents_name = inputs->contains("latents_patchified") ? "latents_patchified" : "latents";
  {
    const nn::ObserveForward observe([&](const std::string& path, const std::string& emitted, const at::Tensor& value) {
      const std::string name = models::vae_intermediate_name(path, emitted);
      EXPECT_EQ(recorded.count(name), 0u) << "intermediate '" << name << "' recorded twice";
      recorded[name] = value.clone();
    });
    const at::Tensor z = vae->denormalize_latents(inputs->read(latents_name));
    recorded["sample"] = vae->decode(z);
  }

  std::vector<std::string> compared;
  // The pipeline's de-normalisation, against the z (and z_patchified) the reference decoded.
  for (const std::string& name : inputs->names()) {
    if (name == latents_name) continue;
    ASSERT_EQ(recorded.count(name), 1u) << "input '" << name << "' was not produced";
    const auto result = tensors_close(GetParam() + " " + name, recorded[name], inputs->read(name), kTol, kTol);
    EXPECT_TRUE(result);
    std::cout << "  compared " << result.message() << "\n";
    compared.push_back(name);
  }
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  for (const std::string& name : outputs->names()) {
    auto it = recorded.find(name);
    if (it == recorded.end()) {
      ADD_FAILURE() << GetParam() << ": expected intermediate '" << name << "' was not produced";
      continue;
    }
    const auto result = tensors_close(GetParam() + " " + name, it->second, outputs->read(name), kTol, kTol);
    EXPECT_TRUE(result);
    std::cout << "  compared " << result.message() << "\n";
    compared.push_back(name);
  }
  std::cout << GetParam() << ": compared " << compared.size() << " golden tensors\n";
  EXPECT_GE(compared.size(), outputs->names().size() + 1);
}

TEST_P(VaeParity, ParametersAreTheDecoderCheckpointKeys) {
  const io::ComponentFolder folder = io::open_component(golden_path(GetParam()), "vae");
  auto vae = models::create_vae(folder);
  const io::Checkpoint checkpoint = folder.weights();
  std::map<std::string, std::vector<int64_t>> declared;
  for (const auto& slot : vae->named_states()) declared[slot.name] = slot.tensor->sizes().vec();
  for (const auto& [name, shape] : declared) {
    ASSERT_TRUE(checkpoint.contains(name)) << "model parameter '" << name << "' is not in the checkpoint";
    EXPECT_EQ(shape, checkpoint.info(name).shape) << name;
  }
  std::vector<std::string> prefixes;  // the ignored globs are prefixes followed by '*'
  for (std::string glob : vae->traits().ignored_checkpoint_keys) {
    if (!glob.empty() && glob.back() == '*') glob.pop_back();
    prefixes.push_back(glob);
  }
  int ignored = 0;
  for (const std::string& name : checkpoint.names()) {
    if (declared.count(name)) continue;
    const bool skipped = std::any_of(prefixes.begin(), prefixes.end(),
                                     [&](const std::string& p) { return name.compare(0, p.size(), p) == 0; });
    EXPECT_TRUE(skipped) << "checkpoint tensor '" << name << "' is neither loaded nor a skipped key";
    EXPECT_TRUE(name.rfind("decoder.", 0) != 0 && name.rfind("post_quant_conv", 0) != 0) << name;
    ++ignored;
  }
  // The golden files hold the encoders too: loaded by the VAEs that have one (FLUX.1, FLUX.2),
  // skipped by the decode-only one (Qwen-Image).
  if (!vae->has_encoder()) {
    EXPECT_GT(ignored, 0);
  }
}

TEST_P(VaeParity, RunVaeCommandWritesTheGoldenNames) {
  const std::string dir = golden_path(GetParam());
  const std::string out = testing::make_temp_dir("run_vae") + "/out.safetensors";
  std::string output;
  ASSERT_EQ(testing::run_command(testing::cli_path() + " run-vae --model " + dir + " --inputs " + dir + " --out " + out,
                                 &output),
            0)
      << output;
  const auto written = io::SafetensorsFile::open(out);
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  for (const std::string& name : outputs->names()) {
    ASSERT_TRUE(written->contains(name)) << "run-vae did not write '" << name << "'";
    EXPECT_TRUE(tensors_close("run-vae " + GetParam() + " " + name, written->read(name), outputs->read(name), kTol, kTol));
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, VaeParity, ::testing::Values("vae_flux1", "vae_flux2", "vae_qwenimage"));

// The VAEs of the end-to-end pipeline cases (real layouts: four blocks, 8x; Qwen-Image's
// temporal upsamplers present but not reached for one frame): the pipeline's decode input to
// its decode output.
class PipelineVaeParity : public ::testing::TestWithParam<std::string> {};

TEST_P(PipelineVaeParity, DecodeMatchesThePipelineDecode) {
  const std::string dir = golden_path(GetParam());
  const io::ComponentFolder folder = io::open_component(dir, "vae");
  auto vae = models::create_vae(folder);
  vae->load(folder.weights(), {});
  EXPECT_EQ(vae->vae_scale_factor(), 8);
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  const at::Tensor sample = vae->decode(outputs->read("vae.decode.input"));
  const auto result =
      tensors_close(GetParam() + " vae.decode.output", sample, outputs->read("vae.decode.output"), kTol, kTol);
  EXPECT_TRUE(result);
  std::cout << "  compared " << result.message() << "\n";
}

INSTANTIATE_TEST_SUITE_P(Golden, PipelineVaeParity,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_qwenimage"));

// ---------------------------------------------------------------------------------------------
// Tiled decoding

at::Tensor random_latents(std::vector<int64_t> shape, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::normal(0.0, 1.0, shape, generator);
}

TEST(VaeTiling, AutoencoderKLWithinOneTileEqualsUntiled) {
  for (const std::string name : {"vae_flux1", "vae_flux2"}) {
    auto vae = load_vae(name);
    // The config's sample_size 64 and two blocks: latent tiles of 32.
    const at::Tensor z = random_latents({1, vae->latent_channels(), 32, 24}, 7);
    const at::Tensor untiled = vae->decode(z);
    vae->enable_tiling();
    EXPECT_TRUE(at::equal(vae->decode(z), untiled)) << name;
  }
}

TEST(VaeTiling, AutoencoderKLMatchesDiffusersTileLoop) {
  for (const std::string name : {"vae_flux1", "vae_flux2"}) {
    auto vae = load_vae(name);
    auto* kl = dynamic_cast<models::AutoencoderKL*>(vae.get());
    auto* flux2 = dynamic_cast<models::AutoencoderKLFlux2*>(vae.get());
    models::AutoencoderKLTiling& tiling = kl ? kl->tiling : flux2->tiling;
    tiling.tile_sample_min_size = 16;  // latent tiles of 8 rows, stride 6, 4 decoded rows blended
    tiling.tile_latent_min_size = 8;
    const at::Tensor z = random_latents({2, vae->latent_channels(), 21, 14}, 11);
    const at::Tensor untiled = vae->decode(z);

    vae->enable_tiling();
    const at::Tensor tiled = vae->decode(z);
    ASSERT_EQ(tiled.sizes(), untiled.sizes()) << name;
    vae->disable_tiling();
    const auto decode_tile = [&](const at::Tensor& tile) { return vae->decode(tile); };
    const at::Tensor expected = reference_tiled_decode(z, tiling.grid(), decode_tile);
    EXPECT_TRUE(tensors_close(name + " tiled vs diffusers' loop", tiled, expected, 1e-6, 0.0));
    // The top-left corner comes from the first tile alone.
    const at::Tensor first = vae->decode(z.slice(2, 0, 8).slice(3, 0, 8)).slice(2, 0, 12).slice(3, 0, 12);
    EXPECT_TRUE(at::equal(tiled.slice(2, 0, 12).slice(3, 0, 12), first)) << name;
    std::cout << name << ": tiled vs untiled max abs diff " << (tiled - untiled).abs().max().item<double>() << "\n";
  }
}

TEST(VaeTiling, QwenImageMatchesDiffusersTileLoopAndSkipsTheClamp) {
  auto vae = load_vae("vae_qwenimage");
  auto* qwen = dynamic_cast<models::AutoencoderKLQwenImage*>(vae.get());
  ASSERT_NE(qwen, nullptr);
  // Within one tile (default 256 pixels = 128 latents at ratio 2): tiled == untiled.
  const at::Tensor small = random_latents({1, 4, 1, 12, 10}, 3);
  const at::Tensor untiled_small = vae->decode(small);
  qwen->enable_tiling(std::nullopt, std::nullopt);
  EXPECT_TRUE(at::equal(vae->decode(small), untiled_small));

  qwen->enable_tiling(16, 12, 12, 8);  // latent tiles 8x6, strides 6x4; blends 4 rows, 4 columns
  const at::Tensor z = random_latents({1, 4, 1, 19, 15}, 5) * 3;
  const at::Tensor tiled = vae->decode(z);
  qwen->disable_tiling();
  std::map<std::string, at::Tensor> recorded;
  const auto decode_tile = [&](const at::Tensor& tile) {
    at::Tensor before_clamp;
    const nn::ObserveForward observe([&](const std::string& path, const std::string& name, const at::Tensor& value) {
      if (models::vae_intermediate_name(path, name) == "decoder_out_before_clamp") before_clamp = value.clone();
    });
    vae->decode(tile);
    return before_clamp;
  };
  const at::Tensor expected = reference_tiled_decode(z, qwen->tile_grid(19, 15), decode_tile);
  ASSERT_EQ(tiled.sizes(), (std::vector<int64_t>{1, 3, 1, 38, 30}));
  EXPECT_TRUE(tensors_close("qwenimage tiled vs diffusers' loop", tiled, expected, 1e-6, 0.0));
}

TEST(VaeTiling, DecoderSeesOneTileAtATime) {
  // A decoder without spatial context (nearest 2x upsampling): diffusers' blend of overlapping
  // tiles gives the untiled result up to rounding, and no call sees more than one tile.
  const at::Tensor z = random_latents({1, 3, 70, 45}, 9);
  models::AutoencoderKLTiling tiling;
  tiling.tile_sample_min_size = 32;
  tiling.tile_latent_min_size = 16;
  int64_t calls = 0;
  int64_t largest = 0;
  const auto upsample = [](const at::Tensor& x) {
    return at::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2});
  };
  const at::Tensor tiled = models::tiled_decode(z, tiling.grid(), [&](const at::Tensor& tile) {
    ++calls;
    largest = std::max(largest, tile.size(2) * tile.size(3));
    return upsample(tile);
  });
  EXPECT_TRUE(tensors_close("nearest decoder tiled vs untiled", tiled, upsample(z), 1e-6, 1e-6));
  EXPECT_LE(largest, 16 * 16);
  EXPECT_EQ(calls, 6 * 4);  // rows at 0, 12, ..., 60; columns at 0, 12, 24, 36
}

}  // namespace
}  // namespace test_parity_vae
}  // namespace shardit
