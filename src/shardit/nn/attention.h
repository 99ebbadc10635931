#pragma once
// Attention pieces shared by the diffusers transformers (attention.py, attention_dispatch.py):
// scaled dot-product attention over [B, H, S, D] and the GELU FeedForward.
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"

namespace shardit::nn {

/// [B, S, H * D] -> [B, S, H, D] with H taken from the width: under tensor parallelism a
/// colwise projection's output holds the local heads, whatever their number.
at::Tensor split_heads(const at::Tensor& x, int64_t head_dim);

/// softmax(q k^T * scale + mask) v. q [B, H, S_q, D], k and v [B, H, S_kv, D]; mask (optional)
/// broadcastable to [B, H, S_q, S_kv], additive (float) or boolean (true = attend). scale
/// defaults to 1/sqrt(D). The softmax runs in fp32 for bf16/fp16 inputs. Uses LibTorch's fused
/// kernel where the linked LibTorch has one. Returns [B, H, S_q, D] in q's dtype.
at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const std::optional<at::Tensor>& mask = std::nullopt,
                                        std::optional<double> scale = std::nullopt);

/// diffusers' GELU module (attention.py's activation with a projection): act(proj(x)).
class GELU : public Module {
 public:
  /// `approximate_tanh`: diffusers' approximate="tanh".
  GELU(int64_t dim_in, int64_t dim_out, bool approximate_tanh, bool bias = true);
  std::string type_name() const override { return "GELU"; }
  /// [..., dim_in] -> [..., dim_out] (a local column shard under colwise parallelism).
  at::Tensor forward(const at::Tensor& x);

  std::shared_ptr<Linear> proj;

 private:
  bool approximate_tanh_;
};

struct FeedForwardOptions {
  explicit FeedForwardOptions(int64_t dim) : dim(dim) {}
  int64_t dim;
  int64_t dim_out = 0;    ///< 0: dim
  int64_t mult = 4;
  int64_t inner_dim = 0;  ///< 0: dim * mult
  /// "gelu-approximate" (GeluTanh) or "gelu" (the exact erf form).
  bool approximate_tanh = true;
  bool bias = true;

  FeedForwardOptions& with_dim_out(int64_t value) { dim_out = value; return *this; }
  FeedForwardOptions& with_inner_dim(int64_t value) { inner_dim = value; return *this; }
  FeedForwardOptions& with_approximate_tanh(bool value) { approximate_tanh = value; return *this; }
};

/// diffusers' FeedForward with a GELU activation: net.2(net.0(x)), where net.0 is GELU (with its
/// `proj`) and net.1 a dropout (identity at inference, no parameters).
class FeedForward : public Module {
 public:
  explicit FeedForward(const FeedForwardOptions& options);
  std::string type_name() const override { return "FeedForward"; }
  /// [..., dim] -> [..., dim_out].
  at::Tensor forward(const at::Tensor& x);

  /// torch.nn.Sequential `net`; its children are registered as "0" and "2".
  class Net : public Module {
   public:
    std::string type_name() const override { return "Sequential"; }
    std::shared_ptr<GELU> act;       ///< net.0
    std::shared_ptr<Linear> linear;  ///< net.2
   private:
    friend class FeedForward;
    template <class M>
    std::shared_ptr<M> add(const std::string& name, std::shared_ptr<M> module) {
      return register_module(name, std::move(module));
    }
  };
  std::shared_ptr<Net> net;
};

}  // namespace shardit::nn
