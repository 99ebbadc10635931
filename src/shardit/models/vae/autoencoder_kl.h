#pragma once
// diffusers' AutoencoderKL (autoencoder_kl.py): FLUX.1's VAE. The pipeline's latents become z =
// latents / scaling_factor + shift_factor, decoded by post_quant_conv (when the config has one)
// and the Decoder; an image is encoded by the Encoder and quant_conv (when the config has one) to
// its posterior's mean, which FluxKontextPipeline normalises as (z - shift_factor) * scaling_factor.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/models/vae/vae.h"

namespace shardit::models {

/// config.json of an AutoencoderKL (same keys, diffusers' defaults).
struct AutoencoderKLConfig {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  /// Empty: one DownEncoderBlock2D per block_out_channels entry (decode-only configs omit it).
  std::vector<std::string> down_block_types;
  std::vector<std::string> up_block_types{"UpDecoderBlock2D"};
  std::vector<int64_t> block_out_channels{64};
  int64_t layers_per_block = 1;
  std::string act_fn = "silu";
  int64_t latent_channels = 4;
  int64_t norm_num_groups = 32;
  int64_t sample_size = 32;
  double scaling_factor = 0.18215;
  std::optional<double> shift_factor;
  bool use_quant_conv = true;
  bool use_post_quant_conv = true;
  bool mid_block_add_attention = true;

  static AutoencoderKLConfig from_json(const nlohmann::json& config, const std::string& source);
};

class AutoencoderKL : public AutoencoderModel {
 public:
  explicit AutoencoderKL(const AutoencoderKLConfig& config, const std::string& source = "AutoencoderKL config");
  std::string type_name() const override { return "AutoencoderKL"; }

  int64_t latent_channels() const override { return config_.latent_channels; }
  int64_t vae_scale_factor() const override;
  /// [B, C, h, w]: latents / scaling_factor (+ shift_factor) (FluxPipeline).
  at::Tensor denormalize_latents(const at::Tensor& latents) const override;
  bool has_encoder() const override { return true; }
  /// [B, C, h, w]: (z - shift_factor) * scaling_factor (FluxKontextPipeline._encode_vae_image).
  at::Tensor normalize_latents(const at::Tensor& z) const override;
  const AutoencoderKLConfig& config() const { return config_; }

  /// The tile settings enable_tiling uses (diffusers' attributes; may be changed).
  AutoencoderKLTiling tiling;

  std::shared_ptr<Decoder> decoder;
  std::shared_ptr<nn::Conv2d> post_quant_conv;  ///< null when use_post_quant_conv is false
  std::shared_ptr<Encoder> encoder;
  std::shared_ptr<nn::Conv2d> quant_conv;  ///< null when use_quant_conv is false

 protected:
  /// z [B, latent_channels, h, w] -> sample [B, out_channels, H, W]; tiled when tiling is on
  /// and z is larger than a tile. Emits post_quant_conv and decoder.* (untiled).
  at::Tensor _decode(const at::Tensor& z) override;
  /// image [B, in_channels, H, W] -> the posterior mean [B, latent_channels, H / f, W / f];
  /// tiled when tiling is on and the image is larger than a tile.
  at::Tensor _encode(const at::Tensor& image) override;

 private:
  AutoencoderKLConfig config_;
};

/// Reads the config keys AutoencoderKL and AutoencoderKLFlux2 share into either config struct
/// (absent keys keep the struct's defaults).
template <class Config>
void read_autoencoder_kl_keys(Config& out, const io::ConfigReader& reader) {
  const int64_t max_dim = io::kMaxConfigDim;
  const int64_t max_blocks = io::kMaxConfigLayers;
  out.in_channels = reader.integer("in_channels", out.in_channels, 1, max_dim);
  out.out_channels = reader.integer("out_channels", out.out_channels, 1, max_dim);
  out.down_block_types = reader.strings("down_block_types", out.down_block_types, max_blocks);
  out.up_block_types = reader.strings("up_block_types", out.up_block_types, max_blocks);
  out.block_out_channels = reader.integers("block_out_channels", out.block_out_channels, 1, max_dim, max_blocks);
  out.layers_per_block = reader.integer("layers_per_block", out.layers_per_block, 1, io::kMaxConfigLayers);
  out.act_fn = reader.string("act_fn", out.act_fn);
  out.latent_channels = reader.integer("latent_channels", out.latent_channels, 1, max_dim);
  out.norm_num_groups = reader.integer("norm_num_groups", out.norm_num_groups, 1, max_dim);
  out.sample_size = reader.integer("sample_size", out.sample_size, 1, max_dim);
  out.use_quant_conv = reader.boolean("use_quant_conv", out.use_quant_conv);
  out.use_post_quant_conv = reader.boolean("use_post_quant_conv", out.use_post_quant_conv);
  out.mid_block_add_attention = reader.boolean("mid_block_add_attention", out.mid_block_add_attention);
  reader.require(!out.block_out_channels.empty(), "block_out_channels is empty");
}

/// The Decoder of either config, with the decoder's `block_out_channels`.
template <class Config>
DecoderOptions decoder_options(const Config& config, std::vector<int64_t> block_out_channels) {
  DecoderOptions options;
  options.in_channels = config.latent_channels;
  options.out_channels = config.out_channels;
  options.up_block_types = config.up_block_types;
  options.block_out_channels = std::move(block_out_channels);
  options.layers_per_block = config.layers_per_block;
  options.norm_num_groups = config.norm_num_groups;
  options.act_fn = config.act_fn;
  options.mid_block_add_attention = config.mid_block_add_attention;
  return options;
}

/// The Encoder of either config (double_z: the posterior's mean and log-variance).
template <class Config>
EncoderOptions encoder_options(const Config& config) {
  EncoderOptions options;
  options.in_channels = config.in_channels;
  options.out_channels = config.latent_channels;
  options.block_out_channels = config.block_out_channels;
  options.down_block_types = config.down_block_types.empty()
                                 ? std::vector<std::string>(config.block_out_channels.size(), "DownEncoderBlock2D")
                                 : config.down_block_types;
  options.layers_per_block = config.layers_per_block;
  options.norm_num_groups = config.norm_num_groups;
  options.act_fn = config.act_fn;
  options.double_z = true;
  options.mid_block_add_attention = config.mid_block_add_attention;
  return options;
}

}  // namespace shardit::models
