#pragma once
// The VAE's blocks from diffusers' unet_2d_blocks.py (UNetMidBlock2D, UpDecoderBlock2D,
// DownEncoderBlock2D)
// and the spatial self-attention the mid block builds from attention_processor.py's Attention.
#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "shardit/models/vae/resnet.h"
#include "shardit/nn/group_norm.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/nn/spatial_parallel_layer.h"

namespace shardit::models {

/// attention_processor.py's Attention as UNetMidBlock2D builds it: self-attention over the H*W
/// positions of a feature map, `group_norm` first, one head of `channels / heads` wide, the
/// residual added and the sum divided by rescale_output_factor (AttnProcessor2_0).
class Attention : public nn::FeatureMapAttention {
 public:
  Attention(int64_t channels, int64_t heads, int64_t norm_num_groups, double eps, double rescale_output_factor = 1.0);
  std::string type_name() const override { return "Attention"; }
  /// [B, C, H, W] -> [B, C, H, W].
  at::Tensor forward(const at::Tensor& hidden_states);

  std::shared_ptr<nn::GroupNorm> group_norm;
  std::shared_ptr<nn::Linear> to_q;
  std::shared_ptr<nn::Linear> to_k;
  std::shared_ptr<nn::Linear> to_v;
  std::shared_ptr<nn::ModuleList<nn::Linear>> to_out;  ///< to_out.0 (to_out.1 is a dropout)

 private:
  int64_t heads_;
  double rescale_output_factor_;
};

struct UNetMidBlock2DOptions {
  explicit UNetMidBlock2DOptions(int64_t in_channels) : in_channels(in_channels) {}
  int64_t in_channels;
  int64_t resnet_groups = 32;
  double resnet_eps = 1e-6;
  bool add_attention = true;
  int64_t attention_head_dim = 1;
  int64_t num_layers = 1;
};

/// resnets.0, then per layer attentions.i (when add_attention) and resnets.i+1.
class UNetMidBlock2D : public nn::Module {
 public:
  explicit UNetMidBlock2D(const UNetMidBlock2DOptions& options);
  std::string type_name() const override { return "UNetMidBlock2D"; }
  /// [B, C, H, W] -> [B, C, H, W].
  at::Tensor forward(const at::Tensor& hidden_states);

  std::shared_ptr<nn::ModuleList<Attention>> attentions;  ///< empty without attention
  std::shared_ptr<nn::ModuleList<ResnetBlock2D>> resnets;
};

struct UpDecoderBlock2DOptions {
  UpDecoderBlock2DOptions(int64_t in_channels, int64_t out_channels) : in_channels(in_channels), out_channels(out_channels) {}
  int64_t in_channels;
  int64_t out_channels;
  int64_t num_layers = 1;
  int64_t resnet_groups = 32;
  double resnet_eps = 1e-6;
  bool add_upsample = true;
};

/// num_layers ResnetBlock2D (the first one in -> out), then an optional Upsample2D.
class UpDecoderBlock2D : public nn::Module {
 public:
  explicit UpDecoderBlock2D(const UpDecoderBlock2DOptions& options);
  std::string type_name() const override { return "UpDecoderBlock2D"; }
  /// [B, in, H, W] -> [B, out, 2H, 2W] (H, W without upsampler).
  at::Tensor forward(const at::Tensor& hidden_states);

  std::shared_ptr<nn::ModuleList<ResnetBlock2D>> resnets;
  std::shared_ptr<nn::ModuleList<Upsample2D>> upsamplers;  ///< null without upsampling
};

struct DownEncoderBlock2DOptions {
  DownEncoderBlock2DOptions(int64_t in_channels, int64_t out_channels)
      : in_channels(in_channels), out_channels(out_channels) {}
  int64_t in_channels;
  int64_t out_channels;
  int64_t num_layers = 1;
  int64_t resnet_groups = 32;
  double resnet_eps = 1e-6;
  bool add_downsample = true;
};

/// num_layers ResnetBlock2D (the first one in -> out), then an optional Downsample2D (padding 0:
/// pad right and bottom by one, stride-2 conv).
class DownEncoderBlock2D : public nn::Module {
 public:
  explicit DownEncoderBlock2D(const DownEncoderBlock2DOptions& options);
  std::string type_name() const override { return "DownEncoderBlock2D"; }
  /// [B, in, H, W] -> [B, out, H / 2, W / 2] (H, W without downsampler).
  at::Tensor forward(const at::Tensor& hidden_states);

  std::shared_ptr<nn::ModuleList<ResnetBlock2D>> resnets;
  std::shared_ptr<nn::ModuleList<Downsample2D>> downsamplers;  ///< null without downsampling
};

}  // namespace shardit::models
