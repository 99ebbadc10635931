#pragma once
// diffusers' AutoencoderKLFlux2 (autoencoder_kl_flux2.py): FLUX.2's VAE. The pipeline's latents
// are 2x2-patchified and normalised by the BatchNorm running statistics `bn`; de-normalising
// multiplies by sqrt(running_var + batch_norm_eps), adds running_mean and unpatchifies, then
// post_quant_conv and the Decoder decode. Encoding runs the Encoder and quant_conv to the
// posterior's mean; the FLUX.2 pipelines then patchify and normalise it (normalize_latents).
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "shardit/models/vae/autoencoder_kl.h"
#include "shardit/models/vae/vae.h"

namespace shardit::models {

/// config.json of an AutoencoderKLFlux2 (same keys, diffusers' defaults).
struct AutoencoderKLFlux2Config {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  /// Empty: one DownEncoderBlock2D per block_out_channels entry.
  std::vector<std::string> down_block_types;
  std::vector<std::string> up_block_types{"UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D",
                                          "UpDecoderBlock2D"};
  std::vector<int64_t> block_out_channels{128, 256, 512, 512};
  /// The decoder's widths when they differ from the encoder's; empty: block_out_channels.
  std::vector<int64_t> decoder_block_out_channels;
  int64_t layers_per_block = 2;
  std::string act_fn = "silu";
  int64_t latent_channels = 32;
  int64_t norm_num_groups = 32;
  int64_t sample_size = 1024;
  bool use_quant_conv = true;
  bool use_post_quant_conv = true;
  bool mid_block_add_attention = true;
  double batch_norm_eps = 1e-4;
  std::vector<int64_t> patch_size{2, 2};

  static AutoencoderKLFlux2Config from_json(const nlohmann::json& config, const std::string& source);
};

/// torch.nn.BatchNorm2d(affine=False) as a holder of the latent statistics (never applied in
/// the forward: the pipelines read running_mean / running_var).
class BatchNorm2d : public nn::Module {
 public:
  explicit BatchNorm2d(int64_t num_features);
  std::string type_name() const override { return "BatchNorm2d"; }

  // Persistent buffers, as in torch (loaded from the checkpoint, never sharded).
  // num_batches_tracked is not used and is skipped on load.
  at::Tensor running_mean;  ///< [num_features]
  at::Tensor running_var;   ///< [num_features]
};

class AutoencoderKLFlux2 : public AutoencoderModel {
 public:
  explicit AutoencoderKLFlux2(const AutoencoderKLFlux2Config& config,
                              const std::string& source = "AutoencoderKLFlux2 config");
  std::string type_name() const override { return "AutoencoderKLFlux2"; }
  parallel::ModelTraits traits() const override;

  int64_t latent_channels() const override { return config_.latent_channels; }
  int64_t vae_scale_factor() const override;
  /// Patchified latents [B, C * p * p, h / p, w / p] -> z [B, C, h, w]: latents *
  /// sqrt(bn.running_var + batch_norm_eps) + bn.running_mean, then unpatchify. Emits
  /// z_patchified and z.
  at::Tensor denormalize_latents(const at::Tensor& latents) const override;
  bool has_encoder() const override { return true; }
  /// z [B, C, h, w] -> [B, 4C, h / 2, w / 2]: patchified, then (x - bn.running_mean) /
  /// sqrt(bn.running_var + batch_norm_eps) (Flux2Pipeline._encode_vae_image).
  at::Tensor normalize_latents(const at::Tensor& z) const override;
  const AutoencoderKLFlux2Config& config() const { return config_; }

  AutoencoderKLTiling tiling;

  std::shared_ptr<Decoder> decoder;
  std::shared_ptr<nn::Conv2d> post_quant_conv;  ///< null when use_post_quant_conv is false
  std::shared_ptr<BatchNorm2d> bn;
  std::shared_ptr<Encoder> encoder;
  std::shared_ptr<nn::Conv2d> quant_conv;  ///< null when use_quant_conv is false

 protected:
  /// z [B, latent_channels, h, w] -> sample [B, out_channels, H, W].
  at::Tensor _decode(const at::Tensor& z) override;
  /// image [B, in_channels, H, W] -> the posterior mean [B, latent_channels, H / f, W / f].
  at::Tensor _encode(const at::Tensor& image) override;

 private:
  AutoencoderKLFlux2Config config_;
};

/// Flux2Pipeline._patchify_latents: [B, C, h, w] -> [B, C * 4, h / 2, w / 2].
at::Tensor patchify_latents(const at::Tensor& latents);
/// Flux2Pipeline._unpatchify_latents: [B, C * 4, h, w] -> [B, C, 2h, 2w].
at::Tensor unpatchify_latents(const at::Tensor& latents);

}  // namespace shardit::models
