#include "shardit/nn/norms.h"

#include <vector>

#include <c10/util/Exception.h>

#include "shardit/nn/cpu/fused.h"

namespace shardit::nn {

namespace {

bool is_reduced_float(at::ScalarType type) { return type == at::kBFloat16 || type == at::kHalf; }

void check_last_dim(const Module& norm, const at::Tensor& x, int64_t expected) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == expected, norm.type_name(), " '", norm.path(), "': input has shape ",
              x.sizes(), ", expected the last dimension to be ", expected);
}

}  // namespace

at::Tensor layer_norm(const at::Tensor& x, double eps) {
  const at::Tensor x32 = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  at::Tensor y = at::layer_norm(x32, {x.size(-1)}, /*weight=*/{}, /*bias=*/{}, eps);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

LayerNorm::LayerNorm(const LayerNormOptions& options) : options_(options) {
  if (options_.elementwise_affine) {
    register_parameter("weight", &weight, {options_.normalized_shape});
    register_parameter("bias", &bias, {options_.normalized_shape});
  }
}

at::Tensor LayerNorm::forward(const at::Tensor& x) const {
  check_last_dim(*this, x, options_.normalized_shape);
  if (!options_.elementwise_affine) return layer_norm(x, options_.eps);
  const at::Tensor x32 = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  at::Tensor y = at::layer_norm(x32, {options_.normalized_shape}, weight.to(at::kFloat),
                                bias.to(at::kFloat), options_.eps);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

RMSNorm::RMSNorm(const RMSNormOptions& options) : options_(options) {
  if (options_.elementwise_affine) register_parameter("weight", &weight, {options_.dim});
}

at::Tensor RMSNorm::forward(const at::Tensor& x) const {
  check_last_dim(*this, x, options_.dim);
  at::Tensor fused;
  if (cpu::try_rms_norm(x, options_.elementwise_affine ? weight : at::Tensor(), options_.eps, fused)) return fused;
  const at::Tensor x32 = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  // [..., 1]
  const at::Tensor inv_rms = at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true).add_(options_.eps));
  at::Tensor y = x32 * inv_rms;
  if (!options_.elementwise_affine) return y.to(x.scalar_type());
  if (is_reduced_float(weight.scalar_type())) return y.to(weight.scalar_type()).mul_(weight);
  return y.mul_(weight).to(x.scalar_type());
}

namespace {
/// A per-sample [B, D] value as [B, 1, D], broadcast over the sequence; per-token [B, S, D] as is.
at::Tensor over_sequence(const at::Tensor& value) { return value.dim() == 2 ? value.unsqueeze(1) : value; }
}  // namespace

at::Tensor modulate(at::Tensor normed, const at::Tensor& shift, const at::Tensor& scale) {
  return normed.mul_(1 + over_sequence(scale)).add_(over_sequence(shift));
}

at::Tensor modulated_layer_norm(const at::Tensor& x, double eps, const at::Tensor& shift, const at::Tensor& scale) {
  at::Tensor fused;
  if (cpu::try_layer_norm_modulate(x, eps, shift, scale, fused)) return fused;
  return modulate(layer_norm(x, eps), shift, scale);
}

at::Tensor gated_residual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& update) {
  return at::addcmul(residual, over_sequence(gate), update);
}

AdaLayerNormContinuous::AdaLayerNormContinuous(const AdaLayerNormContinuousOptions& options) : eps_(options.eps) {
  linear = register_module("linear", std::make_shared<Linear>(LinearOptions(options.conditioning_embedding_dim,
                                                                            2 * options.embedding_dim)
                                                                  .with_bias(options.bias)));
}

at::Tensor AdaLayerNormContinuous::forward(const at::Tensor& x, const at::Tensor& conditioning, at::Tensor* emb_out) {
  // [B, 2D] = [scale | shift]
  const at::Tensor emb = linear->forward(at::silu(conditioning).to(x.scalar_type()));
  if (emb_out != nullptr) *emb_out = emb;
  const std::vector<at::Tensor> chunks = emb.chunk(2, 1);
  return modulated_layer_norm(x, eps_, /*shift=*/chunks[1], /*scale=*/chunks[0]);
}

}  // namespace shardit::nn
