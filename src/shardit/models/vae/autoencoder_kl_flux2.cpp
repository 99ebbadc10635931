#include "shardit/models/vae/autoencoder_kl_flux2.h"

#include <c10/util/Exception.h>

namespace shardit::models {

AutoencoderKLFlux2Config AutoencoderKLFlux2Config::from_json(const nlohmann::json& config, const std::string& source) {
  const io::ConfigReader reader(config, source);
  AutoencoderKLFlux2Config out;
  read_autoencoder_kl_keys(out, reader);
  out.decoder_block_out_channels =
      reader.optional_integers("decoder_block_out_channels", 1, io::kMaxConfigDim, io::kMaxConfigLayers)
          .value_or(std::vector<int64_t>{});
  // Added to the running variance under a square root: never negative.
  out.batch_norm_eps = reader.number("batch_norm_eps", out.batch_norm_eps, 0.0, 1.0);
  out.patch_size = reader.integers("patch_size", out.patch_size, 1, io::kMaxConfigDim, io::kMaxConfigLayers);
  reader.require(out.patch_size == std::vector<int64_t>({2, 2}), "patch_size ", c10::IntArrayRef(out.patch_size),
                 " is not supported; the FLUX.2 pipelines pack 2x2 patches ([2, 2])");
  return out;
}

BatchNorm2d::BatchNorm2d(int64_t num_features) {
  register_buffer("running_mean", &running_mean, {num_features});
  register_buffer("running_var", &running_var, {num_features});
}

AutoencoderKLFlux2::AutoencoderKLFlux2(const AutoencoderKLFlux2Config& config, const std::string& source)
    : config_(config) {
  const DecoderOptions options = decoder_options(
      config, config.decoder_block_out_channels.empty() ? config.block_out_channels : config.decoder_block_out_channels);
  decoder = register_module("decoder", std::make_shared<Decoder>(options, source));
  if (config.use_post_quant_conv) {
    post_quant_conv = register_module(
        "post_quant_conv",
        std::make_shared<nn::Conv2d>(nn::Conv2dOptions(config.latent_channels, config.latent_channels, 1)));
  }
  bn = register_module("bn", std::make_shared<BatchNorm2d>(config.latent_channels * 4));
  encoder = register_module("encoder", std::make_shared<Encoder>(encoder_options(config), source));
  if (config.use_quant_conv) {
    quant_conv = register_module(
        "quant_conv",
        std::make_shared<nn::Conv2d>(nn::Conv2dOptions(2 * config.latent_channels, 2 * config.latent_channels, 1)));
  }
  // diffusers derives the latent tile from the encoder's block count.
  tiling = AutoencoderKLTiling::from_config(config.sample_size, config.block_out_channels.size());
}

parallel::ModelTraits AutoencoderKLFlux2::traits() const {
  parallel::ModelTraits traits = AutoencoderModel::traits();
  traits.ignored_checkpoint_keys.push_back("bn.num_batches_tracked");
  return traits;
}

int64_t AutoencoderKLFlux2::vae_scale_factor() const {
  return int64_t{1} << (config_.block_out_channels.size() - 1);
}

at::Tensor patchify_latents(const at::Tensor& latents) {
  TORCH_CHECK(latents.dim() == 4 && latents.size(2) % 2 == 0 && latents.size(3) % 2 == 0,
              "patchify_latents: latents have shape ", latents.sizes(), ", expected [B, C, h, w] with even h and w");
  const int64_t b = latents.size(0), c = latents.size(1), h = latents.size(2), w = latents.size(3);
  // [B, C, h/2, 2, w/2, 2] -> [B, C, 2, 2, h/2, w/2] -> [B, 4C, h/2, w/2]
  return latents.view({b, c, h / 2, 2, w / 2, 2}).permute({0, 1, 3, 5, 2, 4}).reshape({b, c * 4, h / 2, w / 2});
}

at::Tensor unpatchify_latents(const at::Tensor& latents) {
  TORCH_CHECK(latents.dim() == 4 && latents.size(1) % 4 == 0, "unpatchify_latents: latents have shape ",
              latents.sizes(), ", expected [B, 4C, h, w]");
  const int64_t b = latents.size(0), c = latents.size(1), h = latents.size(2), w = latents.size(3);
  // [B, C, 2, 2, h, w] -> [B, C, h, 2, w, 2] -> [B, C, 2h, 2w]
  return latents.reshape({b, c / 4, 2, 2, h, w}).permute({0, 1, 4, 2, 5, 3}).reshape({b, c / 4, h * 2, w * 2});
}

at::Tensor AutoencoderKLFlux2::denormalize_latents(const at::Tensor& latents) const {
  check_latents(type_name(), latents, 4, config_.latent_channels * 4, "patchified [B, 4C, h/2, w/2]");
  const at::Tensor mean = bn->running_mean.view({1, -1, 1, 1}).to(latents.device(), latents.scalar_type());
  const at::Tensor std = at::sqrt(bn->running_var.view({1, -1, 1, 1}) + config_.batch_norm_eps)
                             .to(latents.device(), latents.scalar_type());
  const at::Tensor z_patchified = latents * std + mean;
  emit("z_patchified", z_patchified);
  at::Tensor z = unpatchify_latents(z_patchified);
  emit("z", z);
  return z;
}

at::Tensor AutoencoderKLFlux2::_decode(const at::Tensor& z) {
  check_latents(type_name(), z, 4, config_.latent_channels, "[B, C, h, w]");
  return decode_2d(*this, post_quant_conv.get(), *decoder, z, use_tiling_ ? &tiling : nullptr);
}

at::Tensor AutoencoderKLFlux2::_encode(const at::Tensor& image) {
  check_image(type_name(), image, config_.in_channels, vae_scale_factor());
  return encode_2d(*this, *encoder, quant_conv.get(), image, use_tiling_ ? &tiling : nullptr);
}

at::Tensor AutoencoderKLFlux2::normalize_latents(const at::Tensor& z) const {
  check_latents(type_name(), z, 4, config_.latent_channels, "[B, C, h, w]");
  TORCH_CHECK(z.size(2) % 2 == 0 && z.size(3) % 2 == 0, type_name(), ": encoded latents have shape ", z.sizes(),
              "; patchifying needs an even height and width (an image whose sides are multiples of ",
              2 * vae_scale_factor(), " pixels)");
  const at::Tensor patched = patchify_latents(z);  // [B, 4C, h / 2, w / 2]
  const at::Tensor mean = bn->running_mean.view({1, -1, 1, 1}).to(z.device(), z.scalar_type());
  const at::Tensor std = at::sqrt(bn->running_var.view({1, -1, 1, 1}) + config_.batch_norm_eps)
                             .to(z.device(), z.scalar_type());
  return (patched - mean) / std;
}

}  // namespace shardit::models
