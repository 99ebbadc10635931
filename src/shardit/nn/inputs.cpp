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

JointStreams check_joint_streams(const std::string& where, const at::Tensor& hidden_states, int64_t in_channels,
                                 const at::Tensor& encoder_hidden_states, int64_t joint_attention_dim) {
  const auto image = check_shape(where, "hidden_states", hidden_states, {"B", "N", in_channels});
  const auto text =
      check_shape(where, "encoder_hidden_states", encoder_hidden_states, {{"B", image[0]}, "L", joint_attention_dim});
  return {image[0], image[1], text[1]};
}

std::optional<at::Tensor> optional_per_sample_values(const std::string& where, const char* name,
                                                     const std::optional<at::Tensor>& tensor, bool expected,
                                                     int64_t batch, at::Device device) {
  const bool given = tensor.has_value() && tensor->defined();
  if (expected) {
    TORCH_CHECK(given, where, ": this model embeds ", name, " (", name, "_embeds=true); pass `", name, "` [B]");
    return per_sample_values(where, name, *tensor, batch, device);
  }
  TORCH_CHECK(!given, where, ": this model has no ", name, " embedder (", name, "_embeds=false); pass no `", name,
              "`");
  return std::nullopt;
}

std::string non_finite(const at::Tensor& tensor) {
  if (!tensor.defined() || !at::isFloatingType(tensor.scalar_type())) return "";
  const at::Tensor bad = at::logical_not(at::isfinite(tensor)).flatten();
  const int64_t count = bad.sum().item<int64_t>();
  if (count == 0) return "";
  const int64_t first = bad.nonzero().flatten()[0].item<int64_t>();
  std::ostringstream out;
  out << count << " of " << tensor.numel() << " values are NaN or infinite (first at flat index " << first << ")";
  return out.str();
}

}  // namespace shardit::nn
