#pragma once
// torch.nn.GroupNorm with affine parameters, over [B, C, *] (computed in fp32 for bf16/fp16
// inputs, cast back). Under spatial parallelism (nn/spatial_parallel_layer.h) the statistics cover
// every band of the map.
#include <ATen/ATen.h>

#include <string>

#include "shardit/nn/module.h"
#include "shardit/nn/spatial_parallel_layer.h"

namespace shardit::nn {

struct GroupNormOptions {
  GroupNormOptions(int64_t num_groups, int64_t num_channels) : num_groups(num_groups), num_channels(num_channels) {}
  int64_t num_groups;
  int64_t num_channels;
  double eps = 1e-5;

  GroupNormOptions& with_eps(double value) { eps = value; return *this; }
};

/// torch.nn.GroupNorm(affine=True): per sample and group of C / G channels, (x - mean) /
/// sqrt(var + eps), then * weight + bias per channel. Split over a group, the mean and the
/// (biased) variance are those of the whole map: the sums of x, then of (x - mean)^2, over each
/// band are all-reduced (two passes, as exact as the single-rank statistics).
class GroupNorm : public Module, public SpatialParallelLayer {
 public:
  explicit GroupNorm(const GroupNormOptions& options);
  std::string type_name() const override { return "GroupNorm"; }
  /// [B, C, *] -> [B, C, *].
  at::Tensor forward(const at::Tensor& x) const;

  at::Tensor weight;  ///< [C]
  at::Tensor bias;    ///< [C]

 private:
  /// The normalisation with statistics all-reduced over the spatial group.
  at::Tensor forward_banded(const at::Tensor& x) const;

  GroupNormOptions options_;
};

}  // namespace shardit::nn
