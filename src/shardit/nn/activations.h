#pragma once
// Activation functions by config name (diffusers' get_activation, transformers' ACT2FN).
#include <ATen/ATen.h>

#include <string>

namespace shardit::nn {

enum class Activation {
  QuickGelu,  ///< "quick_gelu": x * sigmoid(1.702 x) (CLIP)
  Gelu,       ///< "gelu": the exact erf form
  GeluTanh,   ///< "gelu_new", "gelu_pytorch_tanh": the tanh approximation (T5 v1.1)
  Relu,       ///< "relu" (T5 v1.0)
  SiLU,       ///< "silu", "swish" (Qwen, the diffusers embedders)
};

/// The activation named `name` in a config; an error naming `source`, the key and the supported
/// names otherwise.
Activation parse_activation(const std::string& name, const std::string& source, const char* key);

/// x = gelu(x, approximate="tanh") in place (the fused CPU kernel where it applies); returns x.
at::Tensor& gelu_tanh_(at::Tensor& x);

/// act(x), in x's dtype.
at::Tensor activate(const at::Tensor& x, Activation activation);

}  // namespace shardit::nn
