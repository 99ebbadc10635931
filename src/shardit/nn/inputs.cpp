#include "shardit/nn/inputs.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace shardit::nn {

namespace {

std::string describe(const std::vector<Dim>& dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out << ", ";
    if (dims[i].symbol != nullptr) {
      out << dims[i].symbol;
      if (dims[i].size >= 0) out << "=" << dims[i].size;
    } else if (dims[i].size >= 0) {
      out << dims[i].size;
    } else {
      out << "*";
    }
  }
  out << "]";
  return out.str();
}

bool fits(const at::Tensor& tensor, const std::vector<Dim>& dims) {
  if (!tensor.defined() || tensor.dim() != static_cast<int64_t>(dims.size())) return false;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i].size >= 0 && tensor.size(static_cast<int64_t>(i)) != dims[i].size) return false;
  }
  return true;
}

std::string given(const at::Tensor& tensor) {
  return tensor.defined() ? c10::str(tensor.sizes()) : std::string("nothing");
}

}  // namespace

std::vector<int64_t> check_shape(const std::string& where, const char* name, const at::Tensor& tensor,
                                 const std::vector<Dim>& dims) {
  TORCH_CHECK(fits(tensor, dims), where, ": ", name, " must be ", describe(dims), ", got ", given(tensor));
  return tensor.sizes().vec();
}

size_t check_shape_any(const std::string& where, const char* name, const at::Tensor& tensor,
                       const std::vector<std::vector<Dim>>& shapes) {
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (fits(tensor, shapes[i])) return i;
  }
  std::string expected;
  for (size_t i = 0; i < shapes.size(); ++i) expected += (i ? " or " : "") + describe(shapes[i]);
  TORCH_CHECK(false, where, ": ", name, " must be ", expected, ", got ", given(tensor));
}

at::Tensor per_sample_values(const std::string& where, const char* name, const at::Tensor& tensor, int64_t batch,
                             at::Device device) {
  TORCH_CHECK(tensor.defined() && (tensor.numel() == batch || tensor.numel() == 1), where, ": ", name,
              " must hold one value per sample ([", batch, "]) or one for all, got ", given(tensor));
  return tensor.to(device, at::kFloat).reshape({-1}).expand({batch}).contiguous();
}

}  // namespace shardit::nn
