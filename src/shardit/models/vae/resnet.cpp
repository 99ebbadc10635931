#include "shardit/models/vae/resnet.h"

#include <c10/util/Exception.h>

namespace shardit::models {

ResnetBlock2D::ResnetBlock2D(const ResnetBlock2DOptions& options) : options_(options) {
  norm1 = register_module(
      "norm1", std::make_shared<nn::GroupNorm>(nn::GroupNormOptions(options.groups, options.in_channels).with_eps(options.eps)));
  conv1 = register_module(
      "conv1", std::make_shared<nn::Conv2d>(nn::Conv2dOptions(options.in_channels, options.out_channels, 3).with_padding(1)));
  norm2 = register_module(
      "norm2", std::make_shared<nn::GroupNorm>(nn::GroupNormOptions(options.groups, options.out_channels).with_eps(options.eps)));
  conv2 = register_module(
      "conv2", std::make_shared<nn::Conv2d>(nn::Conv2dOptions(options.out_channels, options.out_channels, 3).with_padding(1)));
  if (options.in_channels != options.out_channels) {
    conv_shortcut = register_module(
        "conv_shortcut", std::make_shared<nn::Conv2d>(nn::Conv2dOptions(options.in_channels, options.out_channels, 1)));
  }
}

at::Tensor ResnetBlock2D::forward(const at::Tensor& input_tensor) {
  // [B, in, H, W]
  at::Tensor hidden_states = at::silu(norm1->forward(input_tensor));
  hidden_states = conv1->forward(hidden_states);
  hidden_states = at::silu(norm2->forward(hidden_states));
  hidden_states = conv2->forward(hidden_states);  // [B, out, H, W]
  const at::Tensor shortcut = conv_shortcut ? conv_shortcut->forward(input_tensor) : input_tensor;
  at::Tensor output = shortcut + hidden_states;
  if (options_.output_scale_factor != 1.0) output = output / options_.output_scale_factor;
  return output;
}

Upsample2D::Upsample2D(int64_t channels, int64_t out_channels) {
  conv = register_module("conv", std::make_shared<nn::Conv2d>(nn::Conv2dOptions(channels, out_channels, 3).with_padding(1)));
}

at::Tensor Upsample2D::forward(const at::Tensor& hidden_states) {
  // [B, C, H, W] -> [B, C, 2H, 2W]: F.interpolate(scale_factor=2.0, mode="nearest")
  const at::Tensor upsampled = at::upsample_nearest2d(hidden_states, {hidden_states.size(2) * 2, hidden_states.size(3) * 2});
  return conv->forward(upsampled);
}

Downsample2D::Downsample2D(int64_t channels, int64_t out_channels) {
  conv = register_module("conv",
                         std::make_shared<nn::Conv2d>(nn::Conv2dOptions(channels, out_channels, 3).with_stride(2)));
}

at::Tensor Downsample2D::forward(const at::Tensor& hidden_states) {
  // [B, C, H, W] -> [B, out, H / 2, W / 2]. The inner Conv2d is a "same" layer only in name: its
  // weights run through downsample_rows, as stride 2 never bands.
  return downsample_rows(hidden_states, conv->weight, conv->bias, "Downsample2D '" + path() + "'");
}

}  // namespace shardit::models
