#include "shardit/nn/conv.h"

#include <c10/util/Exception.h>

namespace shardit::nn {

namespace {

void check_input(const char* type, const at::Tensor& x, int64_t dims, int64_t in_channels) {
  TORCH_CHECK(x.dim() == dims && x.size(1) == in_channels, type, ": input has shape ", x.sizes(), ", expected ",
              dims, " dimensions with ", in_channels, " channels in dimension 1");
}

// Under spatial parallelism only a "same" convolution along the height keeps every band's rows.
void check_banded(const Module& layer, int64_t kernel, int64_t stride, int64_t padding) {
  TORCH_CHECK(stride == 1 && kernel == 2 * padding + 1, layer.type_name(), " '", layer.path(),
              "': spatial parallelism needs stride 1 and kernel 2 * padding + 1 along the height, got kernel ",
              kernel, ", stride ", stride, ", padding ", padding);
}

}  // namespace

Conv2d::Conv2d(const Conv2dOptions& options) : options_(options) {
  register_parameter("weight", &weight,
                     {options_.out_channels, options_.in_channels, options_.kernel_size[0], options_.kernel_size[1]});
  if (options_.bias) register_parameter("bias", &bias, {options_.out_channels});
}

at::Tensor Conv2d::forward(const at::Tensor& x) const {
  check_input("Conv2d", x, 4, options_.in_channels);
  if (spatial_group()) check_banded(*this, options_.kernel_size[0], options_.stride[0], options_.padding[0]);
  return convolve_rows(x, 2, options_.padding[0], [&](const at::Tensor& input, int64_t pad_h) {
    return at::conv2d(input, weight, bias, options_.stride, {pad_h, options_.padding[1]});
  });
}

Conv3d::Conv3d(const Conv3dOptions& options) : options_(options) {
  register_parameter("weight", &weight,
                     {options_.out_channels, options_.in_channels, options_.kernel_size[0], options_.kernel_size[1],
                      options_.kernel_size[2]});
  if (options_.bias) register_parameter("bias", &bias, {options_.out_channels});
}

at::Tensor Conv3d::forward(const at::Tensor& x) const {
  check_input("Conv3d", x, 5, options_.in_channels);
  if (spatial_group()) check_banded(*this, options_.kernel_size[1], options_.stride[1], options_.padding[1]);
  return convolve_rows(x, 3, options_.padding[1], [&](const at::Tensor& input, int64_t pad_h) {
    return at::conv3d(input, weight, bias, options_.stride, {options_.padding[0], pad_h, options_.padding[2]});
  });
}

}  // namespace shardit::nn
