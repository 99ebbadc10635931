#include "shardit/models/builtin.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "shardit/io/safetensors.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/vae/autoencoder_kl.h"

namespace shardit::models {

namespace {

namespace fs = std::filesystem;

// Small enough to run in a blink, large enough that TP=2, 3 and 4 all divide it (12 heads).
nlohmann::json builtin_transformer_config() {
  return {{"_class_name", "FluxTransformer2DModel"},
          {"patch_size", 1},
          {"in_channels", 16},
          {"out_channels", nullptr},
          {"num_layers", 2},
          {"num_single_layers", 2},
          {"attention_head_dim", 16},
          {"num_attention_heads", 12},
          {"joint_attention_dim", 32},
          {"pooled_projection_dim", 32},
          {"guidance_embeds", true},
          {"axes_dims_rope", {4, 6, 6}}};
}

// FLUX.1's VAE layout (no quant convs, scaling and shift factors), 4 latent channels so that the
// packed latents match the transformer's in_channels 16; 4 levels: 8 pixels per latent pixel.
nlohmann::json builtin_vae_config() {
  return {{"_class_name", "AutoencoderKL"},
          {"in_channels", 3},
          {"out_channels", 3},
          {"latent_channels", 4},
          {"block_out_channels", {8, 8, 16, 16}},
          {"up_block_types", {"UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"}},
          {"layers_per_block", 1},
          {"norm_num_groups", 4},
          {"sample_size", 64},
          {"scaling_factor", 0.3611},
          {"shift_factor", 0.1159},
          {"use_quant_conv", false},
          {"use_post_quant_conv", false}};
}

// FLUX.1-dev's scheduler_config.json.
nlohmann::json builtin_scheduler_config() {
  return {{"_class_name", "FlowMatchEulerDiscreteScheduler"},
          {"base_image_seq_len", 256},
          {"base_shift", 0.5},
          {"max_image_seq_len", 4096},
          {"max_shift", 1.15},
          {"num_train_timesteps", 1000},
          {"shift", 3.0},
          {"use_dynamic_shifting", true}};
}

void write_json(const fs::path& path, const nlohmann::json& json) {
  std::ofstream out(path);
  TORCH_CHECK(out.good(), path.string(), ": cannot write");
  out << json.dump(2) << "\n";
}

}  // namespace

std::string default_builtin_model_root() {
  return (fs::temp_directory_path() / "shardit-builtin-3").string();
}

BuiltinModelPaths write_builtin_model(const std::string& root_path) {
  const fs::path root(root_path);
  BuiltinModelPaths paths{root.string(), (root / "transformer").string(), (root / "inputs").string(),
                          (root / "prompt_embeds.safetensors").string()};
  if (fs::exists(root / ".complete")) {
    // The folder lives in a shared temp folder: re-check it (headers and sizes, which catch a
    // truncated or replaced file) instead of failing forever on a damaged copy.
    try {
      io::Checkpoint::open(paths.transformer);
      io::SafetensorsFile::open((root / "inputs" / "inputs.safetensors").string());
      io::Checkpoint::open((root / "vae").string());
      io::SafetensorsFile::open(paths.prompt_embeds);
      return paths;
    } catch (const std::exception&) {
      // Moved aside first, so that ranks starting together never see half a model.
      const fs::path damaged = root.string() + ".damaged-" + std::to_string(::getpid());
      std::error_code error;
      fs::rename(root, damaged, error);
      fs::remove_all(damaged, error);
    }
  }

  // Write into a private folder, then rename: ranks started together never see half a model.
  const fs::path staging = root.string() + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(staging);
  fs::create_directories(staging / "transformer");
  fs::create_directories(staging / "inputs");
  fs::create_directories(staging / "vae");
  fs::create_directories(staging / "scheduler");
  write_json(staging / "model_index.json", {{"_class_name", "FluxPipeline"},
                                            {"transformer", {"diffusers", "FluxTransformer2DModel"}},
                                            {"vae", {"diffusers", "AutoencoderKL"}},
                                            {"scheduler", {"diffusers", "FlowMatchEulerDiscreteScheduler"}}});
  write_json(staging / "vae" / "config.json", builtin_vae_config());
  write_json(staging / "scheduler" / "scheduler_config.json", builtin_scheduler_config());
  const nlohmann::json config = builtin_transformer_config();
  write_json(staging / "transformer" / "config.json", config);

  FluxTransformer2DModel model(FluxTransformer2DModelConfig::from_json(config, "built-in config"));
  auto generator = at::make_generator<at::CPUGeneratorImpl>(20261130);
  std::vector<std::pair<std::string, at::Tensor>> shards[2];
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total_size = 0;
  const char* shard_names[2] = {"diffusion_pytorch_model-00001-of-00002.safetensors",
                                "diffusion_pytorch_model-00002-of-00002.safetensors"};
  for (const auto& slot : model.named_parameters()) {
    // Weights large enough that every layer matters in the output.
    at::Tensor values = at::normal(0.0, 0.2, slot.tensor->sizes(), generator, at::TensorOptions().dtype(at::kFloat));
    const int shard = slot.name.rfind("single_transformer_blocks", 0) == 0 ? 1 : 0;
    shards[shard].emplace_back(slot.name, values);
    weight_map[slot.name] = shard_names[shard];
    total_size += values.numel() * 4;
  }
  for (int s = 0; s < 2; ++s) io::save_safetensors((staging / "transformer" / shard_names[s]).string(), shards[s]);
  write_json(staging / "transformer" / "diffusion_pytorch_model.safetensors.index.json",
             {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}});

  // One input case: B=2, a 3x4 latent token grid, 6 text tokens.
  const int64_t batch = 2, grid_h = 3, grid_w = 4, text_len = 6;
  const auto randn = [&](std::vector<int64_t> shape) {
    return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kFloat));
  };
  const at::Tensor positions = at::arange(grid_h * grid_w, at::kLong);
  const at::Tensor img_ids =
      at::stack({at::zeros_like(positions), positions.div(grid_w, "floor"), positions.remainder(grid_w)}, 1)
          .to(at::kFloat);
  io::save_safetensors((staging / "inputs" / "inputs.safetensors").string(),
                       {{"hidden_states", randn({batch, grid_h * grid_w, 16})},
                        {"encoder_hidden_states", randn({batch, text_len, 32})},
                        {"pooled_projections", randn({batch, 32})},
                        {"timestep", at::tensor({0.75f, 0.25f})},
                        {"img_ids", img_ids},
                        {"txt_ids", at::zeros({text_len, 3}, at::kFloat)},
                        {"guidance", at::tensor({3.5f, 3.5f})}});
  write_json(staging / "inputs" / "inputs.json",
             {{"model_class", "FluxTransformer2DModel"},
              {"batch_size", batch},
              {"latent_token_grid", {{"height", grid_h}, {"width", grid_w}}},
              {"text_len", text_len},
              {"notes", {"built-in tiny model input; timestep is t/1000 and guidance the guidance scale, as the pipeline passes them"}}});

  // The VAE: normal weights, with norm scales near 1 so that the activations stay in range.
  AutoencoderKL vae(AutoencoderKLConfig::from_json(builtin_vae_config(), "built-in VAE config"));
  std::vector<std::pair<std::string, at::Tensor>> vae_weights;
  for (const auto& slot : vae.named_parameters()) {
    const bool is_norm_weight = slot.name.find("norm") != std::string::npos && slot.tensor->dim() == 1 &&
                                slot.name.size() > 7 && slot.name.compare(slot.name.size() - 7, 7, ".weight") == 0;
    vae_weights.emplace_back(slot.name, at::normal(is_norm_weight ? 1.0 : 0.0, 0.1, slot.tensor->sizes(), generator,
                                                   at::TensorOptions().dtype(at::kFloat)));
  }
  io::save_safetensors((staging / "vae" / "diffusion_pytorch_model.safetensors").string(), vae_weights);

  // Prompt embeddings standing in for one prompt (T5's [1, L, joint] and CLIP's pooled [1, 32]).
  io::save_safetensors((staging / "prompt_embeds.safetensors").string(),
                       {{"prompt_embeds", randn({1, 8, 32})}, {"pooled_prompt_embeds", randn({1, 32})}});
  std::ofstream(staging / ".complete") << "ok\n";

  std::error_code error;
  fs::rename(staging, root, error);
  if (error) {
    // Another process finished first: keep its copy.
    fs::remove_all(staging);
    TORCH_CHECK(fs::exists(root / ".complete"), root.string(), ": cannot create the built-in model: ", error.message());
  }
  return paths;
}

}  // namespace shardit::models
