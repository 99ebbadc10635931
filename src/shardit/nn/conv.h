#pragma once
// torch.nn.Conv2d and torch.nn.Conv3d (zero padding, groups 1, dilation 1): the convolutions of
// the VAE decoders. Replicated layers; tensor parallelism never splits them. Under spatial
// parallelism (nn/spatial_parallel_layer.h) the input is a band of rows and the height padding is the
// neighbouring bands' rows.
#include <ATen/ATen.h>

#include <array>
#include <string>

#include "shardit/nn/module.h"
#include "shardit/nn/spatial_parallel_layer.h"

namespace shardit::nn {

struct Conv2dOptions {
  Conv2dOptions(int64_t in_channels, int64_t out_channels, int64_t kernel_size)
      : in_channels(in_channels), out_channels(out_channels), kernel_size{kernel_size, kernel_size} {}
  int64_t in_channels;
  int64_t out_channels;
  std::array<int64_t, 2> kernel_size;
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};
  bool bias = true;

  Conv2dOptions& with_stride(int64_t value) { stride = {value, value}; return *this; }
  Conv2dOptions& with_padding(int64_t value) { padding = {value, value}; return *this; }
  Conv2dOptions& with_bias(bool value) { bias = value; return *this; }
};

/// torch.nn.Conv2d: weight [out, in, kH, kW], bias [out].
class Conv2d : public Module, public SpatialParallelLayer {
 public:
  explicit Conv2d(const Conv2dOptions& options);
  std::string type_name() const override { return "Conv2d"; }
  /// (kH - 1) / 2: a band needs that many rows of its neighbours.
  int64_t halo_rows() const override { return (options_.kernel_size[0] - 1) / 2; }
  /// [B, in, H, W] -> [B, out, H', W'].
  at::Tensor forward(const at::Tensor& x) const;
  const Conv2dOptions& options() const { return options_; }

  at::Tensor weight;
  at::Tensor bias;  ///< undefined without bias

 private:
  Conv2dOptions options_;
};

struct Conv3dOptions {
  Conv3dOptions(int64_t in_channels, int64_t out_channels, std::array<int64_t, 3> kernel_size)
      : in_channels(in_channels), out_channels(out_channels), kernel_size(kernel_size) {}
  int64_t in_channels;
  int64_t out_channels;
  std::array<int64_t, 3> kernel_size;
  std::array<int64_t, 3> stride{1, 1, 1};
  std::array<int64_t, 3> padding{0, 0, 0};
  bool bias = true;

  Conv3dOptions& with_stride(std::array<int64_t, 3> value) { stride = value; return *this; }
  Conv3dOptions& with_padding(std::array<int64_t, 3> value) { padding = value; return *this; }
};

/// torch.nn.Conv3d: weight [out, in, kT, kH, kW], bias [out].
class Conv3d : public Module, public SpatialParallelLayer {
 public:
  explicit Conv3d(const Conv3dOptions& options);
  std::string type_name() const override { return "Conv3d"; }
  /// (kH - 1) / 2: a band needs that many rows of its neighbours.
  int64_t halo_rows() const override { return (options_.kernel_size[1] - 1) / 2; }
  /// [B, in, T, H, W] -> [B, out, T', H', W'].
  at::Tensor forward(const at::Tensor& x) const;
  const Conv3dOptions& options() const { return options_; }

  at::Tensor weight;
  at::Tensor bias;  ///< undefined without bias

 private:
  Conv3dOptions options_;
};

}  // namespace shardit::nn
