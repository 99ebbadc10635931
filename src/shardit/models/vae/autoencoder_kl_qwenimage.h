#pragma once
// diffusers' AutoencoderKLQwenImage (autoencoder_kl_qwenimage.py): Qwen-Image's video-style VAE
// with causal 3-D convolutions, encoding and decoding one frame (the image). The pipeline's
// latents [B, z_dim, 1, h, w] become z = latents / (1 / latents_std) + latents_mean per channel;
// the decoded sample is clamped to [-1, 1] (not when tiled, as diffusers). The editing pipelines
// encode a reference image to the posterior's mean and normalise it, (z - latents_mean) /
// latents_std.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/models/vae/vae.h"
#include "shardit/nn/conv.h"
#include "shardit/nn/module.h"
#include "shardit/nn/spatial_parallel_layer.h"

namespace shardit::models {

/// config.json of an AutoencoderKLQwenImage (same keys, diffusers' defaults).
struct AutoencoderKLQwenImageConfig {
  int64_t base_dim = 96;
  int64_t z_dim = 16;
  std::vector<int64_t> dim_mult{1, 2, 4, 4};
  int64_t num_res_blocks = 2;
  std::vector<double> attn_scales;
  std::vector<bool> temperal_downsample{false, true, true};
  int64_t input_channels = 3;
  std::vector<double> latents_mean;  ///< z_dim entries
  std::vector<double> latents_std;   ///< z_dim entries

  static AutoencoderKLQwenImageConfig from_json(const nlohmann::json& config, const std::string& source);
};

/// A Conv3d padded causally in time: 2 * padding_t frames before, none after; height and width
/// padded on both sides. Decoding one frame without cache equals a 2-D convolution with the last
/// temporal slice of the kernel, which is what runs then.
class QwenImageCausalConv3d : public nn::Conv3d {
 public:
  QwenImageCausalConv3d(int64_t in_channels, int64_t out_channels, std::array<int64_t, 3> kernel_size,
                        std::array<int64_t, 3> padding = {0, 0, 0});
  std::string type_name() const override { return "QwenImageCausalConv3d"; }
  /// [B, in, T, H, W] -> [B, out, T, H, W] (with `same` spatial padding).
  at::Tensor forward(const at::Tensor& x) const;

 private:
  std::array<int64_t, 3> causal_padding_;
};

/// x / max(||x||_2 over channels, 1e-12) * sqrt(dim) * gamma, channels first.
class QwenImageRMS_norm : public nn::Module {
 public:
  /// `images`: gamma [dim, 1, 1] for [B, C, H, W]; otherwise [dim, 1, 1, 1] for [B, C, T, H, W].
  QwenImageRMS_norm(int64_t dim, bool images);
  std::string type_name() const override { return "QwenImageRMS_norm"; }
  at::Tensor forward(const at::Tensor& x) const;

  at::Tensor gamma;

 private:
  double scale_;
};

/// Decoder ("upsample2d", "upsample3d"): 2x nearest upsampling of every frame followed by a 3x3
/// Conv2d halving the channels (`resample.1`). Encoder ("downsample2d", "downsample3d"): one zero
/// row and column padded at the bottom and right, then a 3x3 Conv2d of stride 2 (`resample.1`).
/// The 3d modes also have a causal `time_conv` over frames (doubling them after the first, or
/// halving them with stride 2), not reached for one frame: the reference skips it on the first
/// chunk. Split over a spatial group (a parallel encode), a downsampler's band must start at an
/// even row: its last output row reads the first row of the band below (the halo), the last band
/// reads the zero row, as Downsample2D.
class QwenImageResample : public nn::Module, public nn::SpatialParallelLayer {
 public:
  QwenImageResample(int64_t dim, const std::string& mode);
  std::string type_name() const override { return "QwenImageResample"; }
  /// Up: [B, C, T, H, W] -> [B, C / 2, T, 2H, 2W]; down: [B, C, T, H, W] -> [B, C, T, H / 2, W / 2].
  at::Tensor forward(const at::Tensor& x);

  /// torch.nn.Sequential(Upsample or ZeroPad2d, Conv2d): only `1` has parameters.
  class Sequential : public nn::Module {
   public:
    Sequential(int64_t dim, bool down);
    std::string type_name() const override { return "Sequential"; }
    std::shared_ptr<nn::Conv2d> conv;  ///< resample.1
  };
  std::shared_ptr<Sequential> resample;
  std::shared_ptr<QwenImageCausalConv3d> time_conv;  ///< upsample3d only

 private:
  std::string mode_;
};

/// norm1 -> SiLU -> conv1 -> norm2 -> SiLU -> conv2, plus the (1x1x1 conv_shortcut) input.
class QwenImageResidualBlock : public nn::Module {
 public:
  QwenImageResidualBlock(int64_t in_dim, int64_t out_dim);
  std::string type_name() const override { return "QwenImageResidualBlock"; }
  /// [B, in, T, H, W] -> [B, out, T, H, W].
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<QwenImageRMS_norm> norm1;
  std::shared_ptr<QwenImageCausalConv3d> conv1;
  std::shared_ptr<QwenImageRMS_norm> norm2;
  std::shared_ptr<QwenImageCausalConv3d> conv2;
  std::shared_ptr<QwenImageCausalConv3d> conv_shortcut;  ///< only when in != out
};

/// Single-head self-attention over the H*W positions of each frame, with a residual.
class QwenImageAttentionBlock : public nn::FeatureMapAttention {
 public:
  explicit QwenImageAttentionBlock(int64_t dim);
  std::string type_name() const override { return "QwenImageAttentionBlock"; }
  /// [B, C, T, H, W] -> [B, C, T, H, W].
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<QwenImageRMS_norm> norm;
  std::shared_ptr<nn::Conv2d> to_qkv;  ///< 1x1, C -> 3C ([q | k | v])
  std::shared_ptr<nn::Conv2d> proj;    ///< 1x1
};

/// resnets.0, attentions.0, resnets.1.
class QwenImageMidBlock : public nn::Module {
 public:
  QwenImageMidBlock(int64_t dim, int64_t num_layers = 1);
  std::string type_name() const override { return "QwenImageMidBlock"; }
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<nn::ModuleList<QwenImageAttentionBlock>> attentions;
  std::shared_ptr<nn::ModuleList<QwenImageResidualBlock>> resnets;
};

/// num_res_blocks + 1 residual blocks, then an optional resampler.
class QwenImageUpBlock : public nn::Module {
 public:
  /// `upsample_mode`: "upsample2d", "upsample3d", or "" (none).
  QwenImageUpBlock(int64_t in_dim, int64_t out_dim, int64_t num_res_blocks, const std::string& upsample_mode);
  std::string type_name() const override { return "QwenImageUpBlock"; }
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<nn::ModuleList<QwenImageResidualBlock>> resnets;
  std::shared_ptr<nn::ModuleList<QwenImageResample>> upsamplers;  ///< null without upsampling
};

class QwenImageDecoder3d : public nn::Module {
 public:
  explicit QwenImageDecoder3d(const AutoencoderKLQwenImageConfig& config);
  std::string type_name() const override { return "QwenImageDecoder3d"; }
  /// One frame [B, z_dim, 1, h, w] -> [B, input_channels, 1, H, W]. Emits conv_in, mid_block,
  /// up_blocks.{i}, norm_out (before the SiLU) and conv_out.
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<QwenImageCausalConv3d> conv_in;
  std::shared_ptr<QwenImageMidBlock> mid_block;
  std::shared_ptr<nn::ModuleList<QwenImageUpBlock>> up_blocks;
  std::shared_ptr<QwenImageRMS_norm> norm_out;
  std::shared_ptr<QwenImageCausalConv3d> conv_out;
};

/// conv_in, down_blocks (residual blocks, attention blocks at `attn_scales`, resamplers), the mid
/// block, norm_out, conv_out to `z_channels` (2 * z_dim: mean and log-variance).
class QwenImageEncoder3d : public nn::Module {
 public:
  QwenImageEncoder3d(const AutoencoderKLQwenImageConfig& config, int64_t z_channels);
  std::string type_name() const override { return "QwenImageEncoder3d"; }
  /// One frame [B, input_channels, 1, H, W] -> [B, z_channels, 1, H / 8, W / 8]. Emits conv_in,
  /// down_blocks.{i}, mid_block, norm_out (before the SiLU) and conv_out.
  at::Tensor forward(const at::Tensor& x);
  std::shared_ptr<QwenImageCausalConv3d> conv_in;
  /// Residual blocks, attention blocks and resamplers in one list, as the checkpoint numbers them.
  std::shared_ptr<nn::ModuleList<nn::Module>> down_blocks;
  std::shared_ptr<QwenImageMidBlock> mid_block;
  std::shared_ptr<QwenImageRMS_norm> norm_out;
  std::shared_ptr<QwenImageCausalConv3d> conv_out;

 private:
  /// down_blocks' forwards, in order (typed when built).
  std::vector<std::function<at::Tensor(const at::Tensor&)>> down_forwards_;
};

class AutoencoderKLQwenImage : public AutoencoderModel {
 public:
  explicit AutoencoderKLQwenImage(const AutoencoderKLQwenImageConfig& config);
  std::string type_name() const override { return "AutoencoderKLQwenImage"; }

  int64_t latent_channels() const override { return config_.z_dim; }
  /// 2^len(temperal_downsample) (the spatial compression ratio).
  int64_t vae_scale_factor() const override;
  /// [B, z_dim, 1, h, w]: latents / (1 / latents_std) + latents_mean (QwenImagePipeline).
  at::Tensor denormalize_latents(const at::Tensor& latents) const override;
  bool has_encoder() const override { return true; }
  /// [B, z_dim, 1, h, w]: (z - latents_mean) / latents_std (the edit pipelines' _encode_vae_image).
  at::Tensor normalize_latents(const at::Tensor& z) const override;

  /// diffusers' enable_tiling with its optional arguments (sample pixels; nullopt keeps the value).
  void enable_tiling(std::optional<int64_t> tile_sample_min_height, std::optional<int64_t> tile_sample_min_width,
                     std::optional<int64_t> tile_sample_stride_height = std::nullopt,
                     std::optional<int64_t> tile_sample_stride_width = std::nullopt);
  using AutoencoderModel::enable_tiling;
  /// The tile grid of the current settings for a latent of `height` x `width`.
  TileGrid tile_grid(int64_t height, int64_t width) const;
  /// diffusers' tiled_encode grid for an image of `height` x `width` pixels: tiles of
  /// tile_sample_min pixels every tile_sample_stride pixels, their latents blended over
  /// (min - stride) / 8 rows and columns, kept stride / 8, cut to the image's latent size.
  TileGrid encode_tile_grid(int64_t height, int64_t width) const;
  const AutoencoderKLQwenImageConfig& config() const { return config_; }

  int64_t tile_sample_min_height = 256;
  int64_t tile_sample_min_width = 256;
  int64_t tile_sample_stride_height = 192;
  int64_t tile_sample_stride_width = 192;

  std::shared_ptr<QwenImageEncoder3d> encoder;
  std::shared_ptr<QwenImageCausalConv3d> quant_conv;
  std::shared_ptr<QwenImageCausalConv3d> post_quant_conv;
  std::shared_ptr<QwenImageDecoder3d> decoder;

 protected:
  /// z [B, z_dim, 1, h, w] -> sample [B, 3, 1, H, W], clamped to [-1, 1] unless tiled. Emits
  /// post_quant_conv, decoder.* and decoder_out_before_clamp (untiled).
  at::Tensor _decode(const at::Tensor& z) override;
  /// image [B, 3, H, W] (or one frame [B, 3, 1, H, W]) -> the posterior's mean [B, z_dim, 1, h, w]:
  /// encoder, quant_conv, the first z_dim channels. Emits encoder.*, quant_conv and moments. Not
  /// tiled (diffusers' tiled_encode, when tiling is on and a side is larger than a tile; not with
  /// a parallel encode); under a parallel encode, this member's band of rows.
  at::Tensor _encode(const at::Tensor& image) override;

 private:
  at::Tensor decode_frame(const at::Tensor& z);
  AutoencoderKLQwenImageConfig config_;
};

}  // namespace shardit::models
