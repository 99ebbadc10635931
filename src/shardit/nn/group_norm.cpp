#include "shardit/nn/group_norm.h"

#include <c10/util/Exception.h>

namespace shardit::nn {

GroupNorm::GroupNorm(const GroupNormOptions& options) : options_(options) {
  TORCH_CHECK(options_.num_groups > 0 && options_.num_channels % options_.num_groups == 0, "GroupNorm: ",
              options_.num_channels, " channels do not divide into ", options_.num_groups,
              " groups; check norm_num_groups in the model config");
  register_parameter("weight", &weight, {options_.num_channels});
  register_parameter("bias", &bias, {options_.num_channels});
}

at::Tensor GroupNorm::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.dim() >= 2 && x.size(1) == options_.num_channels, "GroupNorm: input has shape ", x.sizes(),
              ", expected [B, ", options_.num_channels, ", ...]");
  const bool reduced = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  if (!reduced) return at::group_norm(x, options_.num_groups, weight, bias, options_.eps);
  return at::group_norm(x.to(at::kFloat), options_.num_groups, weight.to(at::kFloat), bias.to(at::kFloat),
                        options_.eps)
      .to(x.scalar_type());
}

}  // namespace shardit::nn
