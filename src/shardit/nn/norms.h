#pragma once
// Normalisations shared by the diffusers transformers. Both compute in fp32 and cast back to the
// input dtype, as PyTorch does for bf16/fp16 inputs.
#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"

namespace shardit::nn {

struct LayerNormOptions {
  explicit LayerNormOptions(int64_t normalized_shape) : normalized_shape(normalized_shape) {}
  int64_t normalized_shape;
  double eps = 1e-5;
  /// torch.nn.LayerNorm's `elementwise_affine`: a learnable `weight` and `bias` of
  /// [normalized_shape].
  bool elementwise_affine = true;

  LayerNormOptions& with_eps(double value) { eps = value; return *this; }
  LayerNormOptions& with_elementwise_affine(bool value) { elementwise_affine = value; return *this; }
};

/// torch.nn.LayerNorm over the last dimension: (x - mean) / sqrt(var + eps) [* weight + bias].
class LayerNorm : public Module {
 public:
  explicit LayerNorm(const LayerNormOptions& options);
  std::string type_name() const override { return "LayerNorm"; }

  /// [..., C] -> [..., C], in the dtype of x.
  at::Tensor forward(const at::Tensor& x) const;

  at::Tensor weight;  ///< [C], only with elementwise_affine
  at::Tensor bias;    ///< [C], only with elementwise_affine

 private:
  LayerNormOptions options_;
};

/// LayerNorm over the last dimension without affine parameters (computed in fp32).
at::Tensor layer_norm(const at::Tensor& x, double eps);

struct RMSNormOptions {
  explicit RMSNormOptions(int64_t dim) : dim(dim) {}
  int64_t dim;
  double eps = 1e-6;
  /// A learnable `weight` of [dim] (diffusers' `elementwise_affine`).
  bool elementwise_affine = true;

  RMSNormOptions& with_eps(double value) { eps = value; return *this; }
  RMSNormOptions& with_elementwise_affine(bool value) { elementwise_affine = value; return *this; }
};

/// diffusers' RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * weight. The mean
/// runs in fp32; with a bf16/fp16 weight the normalised value is cast to the weight's dtype
/// before the product, otherwise the product is in fp32 and cast back to the input dtype.
/// Used per attention head (dim = head_dim), so a tensor-parallel head split leaves it unchanged.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(const RMSNormOptions& options);
  std::string type_name() const override { return "RMSNorm"; }

  /// [..., dim] -> [..., dim], in the dtype of x.
  at::Tensor forward(const at::Tensor& x) const;

  at::Tensor weight;  ///< [dim], only with elementwise_affine

 private:
  RMSNormOptions options_;
};

/// AdaLN modulation: normed * (1 + scale) + shift with per-sample [B, D] values broadcast over the
/// sequence of normed [B, S, D] (or per-token [B, S, D] values), in place on the freshly
/// normalised tensor (the reference's two ops, same roundings).
at::Tensor modulate(at::Tensor normed, const at::Tensor& shift, const at::Tensor& scale);

/// modulate(layer_norm(x, eps), shift, scale): adaLN's normalised, shifted and scaled input. In
/// bf16 on the CPU one fused pass (nn/cpu/fused.h) with the same roundings.
at::Tensor modulated_layer_norm(const at::Tensor& x, double eps, const at::Tensor& shift, const at::Tensor& scale);

/// residual + gate * update with a per-sample [B, D] (or per-token [B, S, D]) gate over [B, S, D],
/// in one pass.
at::Tensor gated_residual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& update);

struct AdaLayerNormContinuousOptions {
  AdaLayerNormContinuousOptions(int64_t embedding_dim, int64_t conditioning_embedding_dim)
      : embedding_dim(embedding_dim), conditioning_embedding_dim(conditioning_embedding_dim) {}
  int64_t embedding_dim;
  int64_t conditioning_embedding_dim;
  double eps = 1e-6;
  bool bias = true;

  AdaLayerNormContinuousOptions& with_eps(double value) { eps = value; return *this; }
  AdaLayerNormContinuousOptions& with_bias(bool value) { bias = value; return *this; }
};

/// diffusers' AdaLayerNormContinuous (LayerNorm without affine): linear(silu(c)) -> [scale, shift]
/// (this order), LN(x) * (1 + scale) + shift. The final norm of the FLUX family.
class AdaLayerNormContinuous : public Module {
 public:
  explicit AdaLayerNormContinuous(const AdaLayerNormContinuousOptions& options);
  std::string type_name() const override { return "AdaLayerNormContinuous"; }
  /// x [B, S, D], conditioning [B, C] -> [B, S, D]. `emb_out` (optional) receives the linear's
  /// output [B, 2D].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& conditioning, at::Tensor* emb_out = nullptr);

  std::shared_ptr<Linear> linear;  ///< C -> 2D

 private:
  double eps_;
};

}  // namespace shardit::nn
