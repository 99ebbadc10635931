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
#include "shardit/nn/norms.h"
#include "shardit/nn/rope.h"

namespace shardit::nn {

/// [B, S, H * D] -> [B, S, H, D] with H taken from the width: under tensor parallelism a
/// colwise projection's output holds the local heads, whatever their number.
at::Tensor split_heads(const at::Tensor& x, int64_t head_dim);

/// softmax(q k^T * scale + mask) v. q [B, H, S_q, D], k and v [B, H, S_kv, D]; mask (optional)
/// broadcastable to [B, H, S_q, S_kv], additive (float) or boolean (true = attend). scale
/// defaults to 1/sqrt(D). The softmax runs in fp32 for bf16/fp16 inputs. Runs on the selected
/// attention backend (nn/attention/backends.h: --attention-backend, "auto" by device). Returns
/// [B, H, S_q, D] in q's dtype.
at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const std::optional<at::Tensor>& mask = std::nullopt,
                                        std::optional<double> scale = std::nullopt);

/// Attention whose tokens are spread over several ranks (context parallelism): what nn::attention
/// calls instead of scaled_dot_product_attention while one is installed on the thread
/// (SequenceParallelAttentionScope). Implemented in parallel/context_parallel.h (Ulysses and ring
/// attention), which installs it around a model's forward; nn only calls through it.
class SequenceParallelAttention {
 public:
  virtual ~SequenceParallelAttention() = default;
  /// q, k, v [B, S_local, H_local, D] of this rank's tokens (RoPE applied, key/value heads
  /// repeated to the query's); key_mask (optional) bool [B or 1, S_local], true = attend.
  /// Returns [B, S_local, H_local, D] in q's dtype: the attention of these queries over the keys
  /// of every rank.
  virtual at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& key_mask, double scale) = 0;
};

/// Installs `attention` for nn::attention on this thread for the scope's lifetime (null: none),
/// restoring the previous one after.
class SequenceParallelAttentionScope {
 public:
  explicit SequenceParallelAttentionScope(SequenceParallelAttention* attention);
  ~SequenceParallelAttentionScope();
  SequenceParallelAttentionScope(const SequenceParallelAttentionScope&) = delete;
  SequenceParallelAttentionScope& operator=(const SequenceParallelAttentionScope&) = delete;

 private:
  SequenceParallelAttention* previous_;
};

/// Per-head query, key and value of one stream, [B, S, H_local, head_dim] each.
struct HeadsQKV {
  at::Tensor query, key, value;
};

/// The q/k/v projections of one stream and their per-head norms (null: not normed).
struct QKVProjections {
  Linear& to_q;
  Linear& to_k;
  Linear& to_v;
  const RMSNorm* norm_q = nullptr;
  const RMSNorm* norm_k = nullptr;
};

/// x [B, S, D] -> q, k, v [B, S, H_local, head_dim], q and k normed per head. Under tensor
/// parallelism the colwise projections give the local heads, whatever their number.
HeadsQKV project_heads(const at::Tensor& x, const QKVProjections& projections, int64_t head_dim);

/// q, k, v already projected ([B, S, H_local * head_dim] each, e.g. cut from a fused projection)
/// -> per-head tensors, q and k normed.
HeadsQKV split_qkv_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const RMSNorm* norm_q,
                         const RMSNorm* norm_k, int64_t head_dim);

/// Attention of one sequence with RoPE on q and k (null: none): [B, S, H_local * head_dim] in
/// the query's dtype. mask as scaled_dot_product_attention's, over [B, H, S, S]; scale defaults to
/// 1/sqrt(head_dim). Grouped-query attention: key/value may hold fewer heads than the query (a
/// divisor of its count); query head h then uses key/value head h / (H_q / H_kv), as transformers'
/// repeat_kv. Under tensor parallelism the local counts are used, whatever they are. Under
/// context parallelism (a SequenceParallelAttention installed) the sequence is this rank's share
/// and the mask may only mask keys (bool, [B or 1, 1, 1, S]).
at::Tensor attention(const HeadsQKV& qkv, const RotaryEmbedding* rope,
                     const std::optional<at::Tensor>& mask = std::nullopt,
                     std::optional<double> scale = std::nullopt);

/// transformers' additive attention mask of the eager path: 0 where query i may attend key j,
/// finfo(dtype).min elsewhere. `causal`: keys j <= i only; `key_mask` (optional, [B, S], nonzero =
/// token): padded keys are masked too. A query row with no key left gets min everywhere, so its
/// softmax is uniform over all keys, as in the reference. Returns [B (1 without key_mask), 1, S, S]
/// in `dtype` on `device`.
at::Tensor additive_attention_mask(int64_t seq_len, const std::optional<at::Tensor>& key_mask, bool causal,
                                   at::ScalarType dtype, at::Device device);

/// The joint attention of the MMDiT transformers: text and image streams, each with its RoPE
/// table (null: none), attend over the joint [text; image] sequence. Returns the text part
/// [B, L, H_local * head_dim] and the image part [B, N, H_local * head_dim]. `key_mask` (optional)
/// masks keys of the joint sequence (bool [B, L + N], true = attend).
std::pair<at::Tensor, at::Tensor> joint_attention(const HeadsQKV& text, const HeadsQKV& image,
                                                  const RotaryEmbedding* text_rope,
                                                  const RotaryEmbedding* image_rope,
                                                  const std::optional<at::Tensor>& key_mask = std::nullopt);

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
