#pragma once
// Validation of a model's forward inputs, one way for every model: each error names the model,
// the argument, the expected shape (with symbols) and what was given.
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace shardit::nn {

/// One expected dimension: a size (-1: any) and an optional symbol ("B", "L"); printed as "B=2",
/// "L" or "32".
struct Dim {
  Dim(int64_t size) : size(size) {}  // NOLINT: a plain size reads best in shape lists
  Dim(const char* symbol, int64_t size = -1) : size(size), symbol(symbol) {}
  int64_t size = -1;
  const char* symbol = nullptr;
};

/// Checks that `tensor` is defined and of shape `dims`; `where` names the model. Returns its sizes.
/// "FluxTransformer2DModel: encoder_hidden_states must be [B=2, L, 32], got [2, 5, 16]"
std::vector<int64_t> check_shape(const std::string& where, const char* name, const at::Tensor& tensor,
                                 const std::vector<Dim>& dims);

/// Checks one of several accepted ranks (e.g. ids [S, 3] or [B, S, 3]); returns the index of the
/// shape that fits.
size_t check_shape_any(const std::string& where, const char* name, const at::Tensor& tensor,
                       const std::vector<std::vector<Dim>>& shapes);

/// A per-sample scalar argument (timestep, guidance) as fp32 [batch] on `device`: one value per
/// sample, or one value for all.
at::Tensor per_sample_values(const std::string& where, const char* name, const at::Tensor& tensor, int64_t batch,
                             at::Device device);

/// The two token streams of an MMDiT forward, checked together: image tokens `hidden_states`
/// [B, N, in_channels] and text tokens `encoder_hidden_states` [B, L, joint_attention_dim].
struct JointStreams {
  int64_t batch;
  int64_t image_len;
  int64_t text_len;
};
JointStreams check_joint_streams(const std::string& where, const at::Tensor& hidden_states, int64_t in_channels,
                                 const at::Tensor& encoder_hidden_states, int64_t joint_attention_dim);

/// An optional per-sample argument (guidance): required when `expected`, refused otherwise, each
/// with a message naming the model and `name`; fp32 [batch] when given.
std::optional<at::Tensor> optional_per_sample_values(const std::string& where, const char* name,
                                                     const std::optional<at::Tensor>& tensor, bool expected,
                                                     int64_t batch, at::Device device);

/// The non-finite values of a floating tensor as a sentence ("3 of 1024 values are NaN or infinite
/// (first at flat index 17)"), or "" when all are finite or the tensor is not floating.
std::string non_finite(const at::Tensor& tensor);

}  // namespace shardit::nn
