#include "shardit/nn/activations.h"

#include <c10/util/Exception.h>

#include "shardit/nn/cpu/fused.h"

namespace shardit::nn {

Activation parse_activation(const std::string& name, const std::string& source, const char* key) {
  if (name == "quick_gelu") return Activation::QuickGelu;
  if (name == "gelu") return Activation::Gelu;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return Activation::GeluTanh;
  if (name == "relu") return Activation::Relu;
  if (name == "silu" || name == "swish") return Activation::SiLU;
  TORCH_CHECK(false, source, ": '", key, "' is '", name,
              "', which is not supported; supported: quick_gelu, gelu, gelu_new, gelu_pytorch_tanh, relu, silu");
}

at::Tensor& gelu_tanh_(at::Tensor& x) {
  if (!cpu::try_gelu_tanh_(x)) at::gelu_(x, "tanh");
  return x;
}

at::Tensor activate(const at::Tensor& x, Activation activation) {
  switch (activation) {
    case Activation::QuickGelu: return x * at::sigmoid(x * 1.702);
    case Activation::Gelu: return at::gelu(x);
    case Activation::GeluTanh: {
      // The fused kernel works in place, on bf16 only: a copy to work on only where it runs.
      if (x.scalar_type() != at::kBFloat16) return at::gelu(x, "tanh");
      at::Tensor y = x.clone(at::MemoryFormat::Contiguous);
      return gelu_tanh_(y);
    }
    case Activation::Relu: return at::relu(x);
    case Activation::SiLU: return at::silu(x);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown activation");
}

}  // namespace shardit::nn
