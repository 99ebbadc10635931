// VAE configs, latents and checkpoints that do not fit fail with messages naming the model, the
// key or the tensor, expected vs got.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/models/vae/autoencoder_kl.h"
#include "shardit/models/vae/autoencoder_kl_flux2.h"
#include "shardit/models/vae/autoencoder_kl_qwenimage.h"
#include "support/test_support.h"

namespace shardit {
namespace test_vae_errors {
namespace {

using testing::error_of;

nlohmann::json kl_config() {
  return {{"_class_name", "AutoencoderKL"},       {"block_out_channels", {32, 32}},
          {"up_block_types", {"UpDecoderBlock2D", "UpDecoderBlock2D"}},
          {"latent_channels", 16},                {"norm_num_groups", 8},
          {"layers_per_block", 1},                {"use_post_quant_conv", false},
          {"scaling_factor", 0.3611},             {"shift_factor", 0.1159}};
}

nlohmann::json qwen_config() {
  return {{"_class_name", "AutoencoderKLQwenImage"}, {"base_dim", 16}, {"z_dim", 4}, {"dim_mult", {1, 2}},
          {"num_res_blocks", 1}, {"temperal_downsample", {false}}, {"latents_mean", {0.0, 0.0, 0.0, 0.0}},
          {"latents_std", {1.0, 1.0, 1.0, 1.0}}};
}

std::string write_component(const nlohmann::json& config) {
  const std::string dir = testing::make_temp_dir("vae");
  std::ofstream(dir + "/config.json") << config.dump();
  return dir;
}

TEST(VaeErrors, WrongLatentChannelsAreNamed) {
  models::AutoencoderKL vae(models::AutoencoderKLConfig::from_json(kl_config(), "config.json"));
  nn::init_random(vae, 1);
  const std::string message = error_of([&] { vae.decode(at::zeros({1, 8, 4, 4})); });
  EXPECT_NE(message.find("AutoencoderKL"), std::string::npos) << message;
  EXPECT_NE(message.find("16 latent channels"), std::string::npos) << message;
  EXPECT_NE(message.find("[1, 8, 4, 4]"), std::string::npos) << message;
  EXPECT_NE(error_of([&] { vae.denormalize_latents(at::zeros({1, 16, 1, 4, 4})); }).find("[B, C, h, w]"),
            std::string::npos);
}

TEST(VaeErrors, EmptyLatentsAreNamed) {
  models::AutoencoderKL vae(models::AutoencoderKLConfig::from_json(kl_config(), "config.json"));
  nn::init_random(vae, 1);
  for (const auto& shape : {std::vector<int64_t>{1, 16, 0, 4}, std::vector<int64_t>{0, 16, 4, 4}}) {
    const std::string message = error_of([&] { vae.decode(at::zeros(shape)); });
    EXPECT_NE(message.find("AutoencoderKL: latents have shape"), std::string::npos) << message;
    EXPECT_NE(message.find("with no element along dimension"), std::string::npos) << message;
  }
}

TEST(VaeErrors, QwenImageTakesOneFrameOfFiveDimensionalLatents) {
  models::AutoencoderKLQwenImage vae(models::AutoencoderKLQwenImageConfig::from_json(qwen_config(), "config.json"));
  nn::init_random(vae, 1);
  EXPECT_NE(error_of([&] { vae.decode(at::zeros({1, 4, 4, 4})); }).find("[B, C, 1, h, w]"), std::string::npos);
  EXPECT_NE(error_of([&] { vae.decode(at::zeros({1, 4, 2, 4, 4})); }).find("2 frames"), std::string::npos);
  EXPECT_EQ(vae.decode(at::zeros({1, 4, 1, 4, 4})).sizes(), (std::vector<int64_t>{1, 3, 1, 8, 8}));
}

TEST(VaeErrors, BadConfigsNameTheKey) {
  auto config = kl_config();
  config["up_block_types"] = {"UpDecoderBlock2D"};
  std::string message = error_of([&] { models::create_vae(io::open_component(write_component(config), "vae")); });
  EXPECT_NE(message.find("up_block_types"), std::string::npos) << message;

  config = kl_config();
  config["up_block_types"] = {"AttnUpDecoderBlock2D", "UpDecoderBlock2D"};
  message = error_of([&] { models::create_vae(io::open_component(write_component(config), "vae")); });
  EXPECT_NE(message.find("AttnUpDecoderBlock2D"), std::string::npos) << message;

  auto qwen = qwen_config();
  qwen["latents_std"] = {1.0, 2.0};
  message = error_of([&] { models::create_vae(io::open_component(write_component(qwen), "vae")); });
  EXPECT_NE(message.find("latents_std"), std::string::npos) << message;
  EXPECT_NE(message.find("z_dim = 4"), std::string::npos) << message;

  qwen = qwen_config();
  qwen["temperal_downsample"] = {false, true};
  message = error_of([&] { models::create_vae(io::open_component(write_component(qwen), "vae")); });
  EXPECT_NE(message.find("temperal_downsample"), std::string::npos) << message;
}

/// The error of creating the VAE of `config` from a component folder; `*file` gets its config.json.
std::string config_error(const nlohmann::json& config, std::string* file) {
  const std::string dir = write_component(config);
  *file = dir + "/config.json";
  return error_of([&] { models::create_vae(io::open_component(dir, "vae")); });
}

// Every VAE config is read strictly: a value out of range, of the wrong type, or null where
// diffusers does not declare the key Optional is refused naming the file and the key.
TEST(VaeErrors, ConfigValuesOutOfRangeOrOfTheWrongTypeNameTheFileAndTheKey) {
  const std::vector<std::pair<const char*, nlohmann::json>> kl_values = {
      {"latent_channels", -4},
      {"block_out_channels", {32, 0}},
      {"norm_num_groups", int64_t{1} << 40},
      {"layers_per_block", 1.5},
      {"sample_size", nullptr},
      {"scaling_factor", "0.3611"},
      {"shift_factor", "0.1159"},
      {"use_post_quant_conv", 0},
      {"up_block_types", {"UpDecoderBlock2D", 2}},
      {"act_fn", false}};
  auto flux2 = kl_config();
  flux2["_class_name"] = "AutoencoderKLFlux2";
  flux2.erase("scaling_factor");
  flux2.erase("shift_factor");
  const std::vector<std::pair<const char*, nlohmann::json>> flux2_values = {
      {"batch_norm_eps", -1e-4}, {"patch_size", {2, "2"}}, {"decoder_block_out_channels", {32, -32}}};
  const std::vector<std::pair<const char*, nlohmann::json>> qwen_values = {
      {"z_dim", 0},
      {"dim_mult", {1, 2.0}},
      {"num_res_blocks", -1},
      {"temperal_downsample", {"false"}},
      {"latents_std", {1.0, 1.0, "1.0", 1.0}},
      {"latents_mean", nullptr}};
  for (const auto& [base, values] : {std::make_pair(kl_config(), kl_values), std::make_pair(flux2, flux2_values),
                                     std::make_pair(qwen_config(), qwen_values)}) {
    for (const auto& [key, value] : values) {
      auto config = base;
      config[key] = value;
      std::string file;
      const std::string message = config_error(config, &file);
      EXPECT_NE(message.find(file + ": key '" + key + "'"), std::string::npos) << key << ": " << message;
    }
  }
  // base_dim x dim_mult is a channel count: bounded like one.
  auto qwen = qwen_config();
  qwen["base_dim"] = int64_t{1} << 20;
  std::string file;
  const std::string message = config_error(qwen, &file);
  EXPECT_NE(message.find(file + ": 'base_dim' x 'dim_mult'"), std::string::npos) << message;
}

// Keys diffusers declares Optional may be null (as released configs write them): the default.
TEST(VaeErrors, OptionalConfigKeysMayBeNull) {
  auto config = kl_config();
  config["shift_factor"] = nullptr;
  EXPECT_FALSE(models::AutoencoderKLConfig::from_json(config, "config.json").shift_factor.has_value());
  config = kl_config();
  config["_class_name"] = "AutoencoderKLFlux2";
  config["decoder_block_out_channels"] = nullptr;
  EXPECT_TRUE(models::AutoencoderKLFlux2Config::from_json(config, "config.json").decoder_block_out_channels.empty());
}

TEST(VaeErrors, UnknownClassListsTheSupportedOnes) {
  auto config = kl_config();
  config["_class_name"] = "AutoencoderTiny";
  const std::string message =
      error_of([&] { models::create_vae(io::open_component(write_component(config), "vae")); });
  EXPECT_NE(message.find("AutoencoderTiny"), std::string::npos) << message;
  EXPECT_NE(message.find("AutoencoderKLQwenImage"), std::string::npos) << message;
}

/// The error of loading an AutoencoderKL checkpoint that lacks the weight `dropped`.
std::string load_error_without(const std::string& dropped) {
  const std::string dir = write_component(kl_config());
  auto vae = models::create_vae(io::open_component(dir, "vae"));
  nn::init_random(*vae, 2);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& slot : vae->named_parameters()) {
    if (slot.name != dropped) tensors.emplace_back(slot.name, *slot.tensor);
  }
  io::save_safetensors(dir + "/diffusion_pytorch_model.safetensors", tensors);
  auto fresh = models::create_vae(io::open_component(dir, "vae"));
  return error_of([&] { fresh->load(io::open_component(dir, "vae").weights(), {}); });
}

TEST(VaeErrors, CheckpointMissingADecoderWeightIsNamed) {
  const std::string message = load_error_without("decoder.conv_out.bias");
  EXPECT_NE(message.find("missing weight(s): decoder.conv_out.bias"), std::string::npos) << message;
}

// AutoencoderKL has an encoder: its weights are required like the decoder's (no longer skipped).
TEST(VaeErrors, CheckpointMissingAnEncoderWeightIsNamed) {
  const std::string message = load_error_without("encoder.conv_in.weight");
  EXPECT_NE(message.find("missing weight(s): encoder.conv_in.weight"), std::string::npos) << message;
}

}  // namespace
}  // namespace test_vae_errors
}  // namespace shardit
