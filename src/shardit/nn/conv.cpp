#include "shardit/nn/conv.h"

#include <c10/util/Exception.h>

namespace shardit::nn {

namespace {

void check_input(const char* type, const at::Tensor& x, int64_t dims, int64_t in_channels) {
  TORCH_CHECK(x.dim() == dims && x.size(1) == in_channels, type, ": input has shape ", x.sizes(), ", expected ",
              dims, " dimensions with ", in_channels, " channels in dimension 1");
}

}  // namespace

Conv2d::Conv2d(const Conv2dOptions& options) : options_(options) {
  register_parameter("weight", &weight,
                     {options_.out_channels, options_.in_channels, options_.kernel_size[0], options_.kernel_size[1]});
  if (options_.bias) register_parameter("bias", &bias, {options_.out_channels});
}

at::Tensor Conv2d::forward(const at::Tensor& x) const {
  check_input("Conv2d", x, 4, options_.in_channels);
  return at::conv2d(x, weight, bias, options_.stride, options_.padding);
}

Conv3d::Conv3d(const Conv3dOptions& options) : options_(options) {
  register_parameter("weight", &weight,
                     {options_.out_channels, options_.in_channels, options_.kernel_size[0], options_.kernel_size[1],
                      options_.kernel_size[2]});
  if (options_.bias) register_parameter("bias", &bias, {options_.out_channels});
}

at::Tensor Conv3d::forward(const at::Tensor& x) const {
  check_input("Conv3d", x, 5, options_.in_channels);
  return at::conv3d(x, weight, bias, options_.stride, options_.padding);
}

}  // namespace shardit::nn
