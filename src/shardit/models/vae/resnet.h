#pragma once
// The VAEs' 2-D building blocks from diffusers' resnet.py (ResnetBlock2D), upsampling.py
// (Upsample2D) and downsampling.py (Downsample2D), as the Decoder and Encoder build them: no time
// embedding, no up/down path inside the resnets.
#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "shardit/nn/conv.h"
#include "shardit/nn/group_norm.h"
#include "shardit/nn/module.h"
#include "shardit/nn/spatial_parallel_layer.h"

namespace shardit::models {

struct ResnetBlock2DOptions {
  ResnetBlock2DOptions(int64_t in_channels, int64_t out_channels) : in_channels(in_channels), out_channels(out_channels) {}
  int64_t in_channels;
  int64_t out_channels;
  int64_t groups = 32;
  double eps = 1e-6;
  double output_scale_factor = 1.0;

  ResnetBlock2DOptions& with_groups(int64_t value) { groups = value; return *this; }
  ResnetBlock2DOptions& with_eps(double value) { eps = value; return *this; }
};

/// conv2(silu(norm2(conv1(silu(norm1(x)))))) + shortcut(x), divided by output_scale_factor. The
/// shortcut is a 1x1 `conv_shortcut` when the channel count changes.
class ResnetBlock2D : public nn::Module {
 public:
  explicit ResnetBlock2D(const ResnetBlock2DOptions& options);
  std::string type_name() const override { return "ResnetBlock2D"; }
  /// [B, in, H, W] -> [B, out, H, W].
  at::Tensor forward(const at::Tensor& input_tensor);

  std::shared_ptr<nn::GroupNorm> norm1;
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::GroupNorm> norm2;
  std::shared_ptr<nn::Conv2d> conv2;
  std::shared_ptr<nn::Conv2d> conv_shortcut;  ///< only when in != out

 private:
  ResnetBlock2DOptions options_;
};

/// Nearest-neighbour 2x upsampling followed by a 3x3 `conv` (use_conv=True).
class Upsample2D : public nn::Module {
 public:
  Upsample2D(int64_t channels, int64_t out_channels);
  std::string type_name() const override { return "Upsample2D"; }
  /// [B, C, H, W] -> [B, out, 2H, 2W].
  at::Tensor forward(const at::Tensor& hidden_states);

  std::shared_ptr<nn::Conv2d> conv;
};

/// The Encoder's Downsample2D (use_conv=True, padding=0): the map is padded with one zero column
/// on the right and one zero row at the bottom, then a 3x3 `conv` of stride 2 without padding.
/// Under spatial parallelism each band must start at an even row and, except the last, hold an
/// even number of rows: its last output row reads the first row of the band below (the halo),
/// the last band reads the zero row.
class Downsample2D : public nn::Module, public nn::SpatialParallelLayer {
 public:
  Downsample2D(int64_t channels, int64_t out_channels);
  std::string type_name() const override { return "Downsample2D"; }
  /// [B, C, H, W] -> [B, out, floor(H / 2), floor(W / 2)].
  at::Tensor forward(const at::Tensor& hidden_states);

  std::shared_ptr<nn::Conv2d> conv;
};

}  // namespace shardit::models
