#include "shardit/models/vae/autoencoder_kl.h"

#include <c10/util/Exception.h>

namespace shardit::models {

AutoencoderKLConfig AutoencoderKLConfig::from_json(const nlohmann::json& config, const std::string& source) {
  const io::ConfigReader reader(config, source);
  AutoencoderKLConfig out;
  read_autoencoder_kl_keys(out, reader);
  // Any finite factors: the pipelines divide by scaling_factor, so only 0 is refused.
  out.scaling_factor = reader.number("scaling_factor", out.scaling_factor, -io::kAnyFiniteNumber, io::kAnyFiniteNumber);
  out.shift_factor = reader.optional_number("shift_factor", -io::kAnyFiniteNumber, io::kAnyFiniteNumber);
  reader.require(out.scaling_factor != 0.0, "scaling_factor must not be 0");
  return out;
}

AutoencoderKL::AutoencoderKL(const AutoencoderKLConfig& config, const std::string& source) : config_(config) {
  const DecoderOptions options = decoder_options(config, config.block_out_channels);
  decoder = register_module("decoder", std::make_shared<Decoder>(options, source));
  if (config.use_post_quant_conv) {
    post_quant_conv = register_module(
        "post_quant_conv",
        std::make_shared<nn::Conv2d>(nn::Conv2dOptions(config.latent_channels, config.latent_channels, 1)));
  }
  // Registered after the decoder so that the decoder's parameters keep their order (the
  // built-in model draws its random weights in that order).
  encoder = register_module("encoder", std::make_shared<Encoder>(encoder_options(config), source));
  if (config.use_quant_conv) {
    quant_conv = register_module(
        "quant_conv",
        std::make_shared<nn::Conv2d>(nn::Conv2dOptions(2 * config.latent_channels, 2 * config.latent_channels, 1)));
  }
  tiling = AutoencoderKLTiling::from_config(config.sample_size, config.block_out_channels.size());
}

int64_t AutoencoderKL::vae_scale_factor() const { return int64_t{1} << (config_.block_out_channels.size() - 1); }

at::Tensor AutoencoderKL::denormalize_latents(const at::Tensor& latents) const {
  check_latents(type_name(), latents, 4, config_.latent_channels, "[B, C, h, w]");
  at::Tensor z = latents / config_.scaling_factor;
  if (config_.shift_factor.has_value()) z = z + *config_.shift_factor;
  emit("z", z);
  return z;
}

at::Tensor AutoencoderKL::_decode(const at::Tensor& z) {
  check_latents(type_name(), z, 4, config_.latent_channels, "[B, C, h, w]");
  return decode_2d(*this, post_quant_conv.get(), *decoder, z, use_tiling_ ? &tiling : nullptr);
}

at::Tensor AutoencoderKL::_encode(const at::Tensor& image) {
  check_image(type_name(), image, config_.in_channels, vae_scale_factor());
  return encode_2d(*this, *encoder, quant_conv.get(), image, use_tiling_ ? &tiling : nullptr);
}

at::Tensor AutoencoderKL::normalize_latents(const at::Tensor& z) const {
  check_latents(type_name(), z, 4, config_.latent_channels, "[B, C, h, w]");
  at::Tensor shifted = z;
  if (config_.shift_factor.has_value()) shifted = shifted - *config_.shift_factor;
  return shifted * config_.scaling_factor;
}

}  // namespace shardit::models
