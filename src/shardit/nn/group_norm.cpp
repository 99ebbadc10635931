#include "shardit/nn/group_norm.h"

#include <c10/util/Exception.h>

#include <vector>

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
  if (spatial_group()) return forward_banded(x);
  const bool reduced = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  if (!reduced) return at::group_norm(x, options_.num_groups, weight, bias, options_.eps);
  return at::group_norm(x.to(at::kFloat), options_.num_groups, weight.to(at::kFloat), bias.to(at::kFloat),
                        options_.eps)
      .to(x.scalar_type());
}

at::Tensor GroupNorm::forward_banded(const at::Tensor& x) const {
  dist::Group& group = *spatial_group();
  const bool reduced = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  const at::Tensor x32 = reduced ? x.to(at::kFloat) : x;
  const int64_t batch = x.size(0);
  const int64_t groups = options_.num_groups;
  // [B, C, *] -> [B, G, C / G * prod(*)]
  const at::Tensor grouped = x32.reshape({batch, groups, -1});
  const auto f64 = x32.options().dtype(at::kDouble);
  // Pass 1: the sum over each band and the band's element count, [B, G + 1], summed in f64.
  at::Tensor sums = at::cat({grouped.sum(-1).to(at::kDouble), at::full({batch, 1}, grouped.size(2), f64)}, 1);
  group.all_reduce(sums);
  const at::Tensor count = sums.narrow(1, groups, 1);    // [B, 1]
  const at::Tensor mean = sums.narrow(1, 0, groups) / count;  // [B, G]
  // Pass 2: the sum of squared deviations from the whole map's mean.
  at::Tensor squares = (grouped - mean.to(x32.scalar_type()).unsqueeze(-1)).square_().sum(-1).to(at::kDouble);
  group.all_reduce(squares);
  const at::Tensor rstd = at::rsqrt(squares / count + options_.eps);  // [B, G]
  // y = x * scale + shift per (sample, channel): scale = rstd * weight, shift = bias - mean * scale.
  const int64_t per_group = options_.num_channels / groups;
  const at::Tensor scale = rstd.repeat_interleave(per_group, 1) * weight.to(at::kDouble);  // [B, C]
  const at::Tensor shift = bias.to(at::kDouble) - mean.repeat_interleave(per_group, 1) * scale;
  std::vector<int64_t> shape(x.dim(), 1);
  shape[0] = batch;
  shape[1] = options_.num_channels;
  const at::Tensor y = at::addcmul(shift.to(x32.scalar_type()).view(shape), x32, scale.to(x32.scalar_type()).view(shape));
  return reduced ? y.to(x.scalar_type()) : y;
}

}  // namespace shardit::nn
