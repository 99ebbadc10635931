#pragma once
// torch.nn.GroupNorm with affine parameters, over [B, C, *] (computed in fp32 for bf16/fp16
// inputs, cast back).
#include <ATen/ATen.h>

#include <string>

#include "shardit/nn/module.h"

namespace shardit::nn {

struct GroupNormOptions {
  GroupNormOptions(int64_t num_groups, int64_t num_channels) : num_groups(num_groups), num_channels(num_channels) {}
  int64_t num_groups;
  int64_t num_channels;
  double eps = 1e-5;

  GroupNormOptions& with_eps(double value) { eps = value; return *this; }
};

/// torch.nn.GroupNorm(affine=True): per sample and group of C / G channels, (x - mean) /
/// sqrt(var + eps), then * weight + bias per channel.
class GroupNorm : public Module {
 public:
  explicit GroupNorm(const GroupNormOptions& options);
  std::string type_name() const override { return "GroupNorm"; }
  /// [B, C, *] -> [B, C, *].
  at::Tensor forward(const at::Tensor& x) const;

  at::Tensor weight;  ///< [C]
  at::Tensor bias;    ///< [C]

 private:
  GroupNormOptions options_;
};

}  // namespace shardit::nn
