#include "shardit/nn/attention.h"
#include "shardit/core/profile.h"
#include "shardit/nn/activations.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "shardit/nn/attention/backends.h"

namespace shardit::nn {

at::Tensor split_heads(const at::Tensor& x, int64_t head_dim) {
  TORCH_CHECK(x.size(-1) % head_dim == 0, "split_heads: width ", x.size(-1), " is not a multiple of head_dim ", head_dim);
  return x.unflatten(-1, {x.size(-1) / head_dim, head_dim});
}

at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  SHARDIT_PROFILE_SCOPE("attention");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "attention: q, k, v must be [B, H, S, D], got shapes ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "attention: incompatible shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  const double softmax_scale = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  return dispatch_attention(AttentionCall{q, k, v, mask, softmax_scale});
}

HeadsQKV split_qkv_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const RMSNorm* norm_q,
                         const RMSNorm* norm_k, int64_t head_dim) {
  // [B, S, H_local * hd] -> [B, S, H_local, hd]
  HeadsQKV out{split_heads(q, head_dim), split_heads(k, head_dim), split_heads(v, head_dim)};
  if (norm_q != nullptr) out.query = norm_q->forward(out.query);
  if (norm_k != nullptr) out.key = norm_k->forward(out.key);
  return out;
}

HeadsQKV project_heads(const at::Tensor& x, const QKVProjections& projections, int64_t head_dim) {
  return split_qkv_heads(projections.to_q.forward(x), projections.to_k.forward(x), projections.to_v.forward(x),
                         projections.norm_q, projections.norm_k, head_dim);
}

namespace {

thread_local SequenceParallelAttention* sequence_parallel_attention = nullptr;

/// An uninitialised [B, S, H, D] tensor of x's dtype for attention inputs written anew (rotated,
/// joined). Its storage is head-major, [B, H, S, D], where the attention runs here: the CPU
/// kernels read each head's rows adjacent and would otherwise lay them out with a transposing copy
/// (1.9 ms for FLUX's [1, 1536, 24, 128] in bf16, three or two per block). Sequence-parallel
/// attention exchanges [B, S, H, D] as it is, so it gets that layout.
at::Tensor empty_heads(int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, const at::TensorOptions& options) {
  if (sequence_parallel_attention != nullptr) return at::empty({batch, seq, heads, head_dim}, options);
  // [B, H, S, D] storage, seen as [B, S, H, D]
  return at::empty({batch, heads, seq, head_dim}, options).transpose(1, 2);
}

at::Tensor rotate(const at::Tensor& x, const RotaryEmbedding& rope) {
  TORCH_CHECK(x.dim() == 4, "apply_rotary_emb: x must be [B, S, H, D], got shape ", x.sizes());
  at::Tensor out = empty_heads(x.size(0), x.size(1), x.size(2), x.size(3), x.options());
  apply_rotary_emb_into(x, rope, out);
  return out;
}

HeadsQKV with_rope(const HeadsQKV& qkv, const RotaryEmbedding* rope) {
  if (rope == nullptr) return qkv;
  return {rotate(qkv.query, *rope), rotate(qkv.key, *rope), qkv.value};
}

}  // namespace

SequenceParallelAttentionScope::SequenceParallelAttentionScope(SequenceParallelAttention* attention)
    : previous_(sequence_parallel_attention) {
  sequence_parallel_attention = attention;
}

SequenceParallelAttentionScope::~SequenceParallelAttentionScope() { sequence_parallel_attention = previous_; }

at::Tensor attention(const HeadsQKV& qkv, const RotaryEmbedding* rope, const std::optional<at::Tensor>& mask,
                     std::optional<double> scale) {
  HeadsQKV rotated = with_rope(qkv, rope);
  const int64_t query_heads = rotated.query.size(2);
  const int64_t kv_heads = rotated.key.size(2);
  if (kv_heads != query_heads) {
    TORCH_CHECK(kv_heads > 0 && query_heads % kv_heads == 0 && rotated.value.size(2) == kv_heads,
                "attention: ", query_heads, " query heads cannot share ", kv_heads,
                " key/value heads (grouped-query attention needs a divisor of the query heads)");
    // [B, S, H_kv, hd] -> [B, S, H_q, hd]: each key/value head serves H_q / H_kv consecutive query heads
    rotated.key = rotated.key.repeat_interleave(query_heads / kv_heads, 2);
    rotated.value = rotated.value.repeat_interleave(query_heads / kv_heads, 2);
  }
  if (sequence_parallel_attention != nullptr) {
    std::optional<at::Tensor> key_mask;
    if (mask.has_value() && mask->defined()) {
      const at::Tensor& m = *mask;
      TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 && m.size(2) == 1 &&
                      m.size(3) == rotated.key.size(1),
                  "attention under context parallelism: only a boolean key mask [B, 1, 1, S] (S = ",
                  rotated.key.size(1), " local tokens) can travel with the keys, got ", m.scalar_type(), " ",
                  m.sizes());
      // [B, 1, 1, S] -> [B, S]
      key_mask = m.flatten(1);
    }
    const double softmax_scale = scale.value_or(1.0 / std::sqrt(static_cast<double>(rotated.query.size(-1))));
    // [B, S, H_local, hd] -> [B, S, H_local * hd]
    return sequence_parallel_attention->attend(rotated.query, rotated.key, rotated.value, key_mask, softmax_scale)
        .flatten(2)
        .to(rotated.query.scalar_type());
  }
  // [B, H_local, S, hd]
  const at::Tensor attended = nn::scaled_dot_product_attention(
      rotated.query.transpose(1, 2), rotated.key.transpose(1, 2), rotated.value.transpose(1, 2), mask, scale);
  // [B, S, H_local * hd]
  return attended.transpose(1, 2).flatten(2).to(rotated.query.scalar_type());
}

at::Tensor additive_attention_mask(int64_t seq_len, const std::optional<at::Tensor>& key_mask, bool causal,
                                   at::ScalarType dtype, at::Device device) {
  const at::Tensor positions = at::arange(seq_len, at::TensorOptions().dtype(at::kLong).device(device));
  // [1, 1, S, S]: true = may attend (key j <= query i when causal)
  at::Tensor allowed = causal ? positions.unsqueeze(1).ge(positions.unsqueeze(0))
                              : at::ones({seq_len, seq_len}, at::TensorOptions().dtype(at::kBool).device(device));
  allowed = allowed.unsqueeze(0).unsqueeze(0);
  if (key_mask.has_value() && key_mask->defined()) {
    TORCH_CHECK(key_mask->dim() == 2 && key_mask->size(1) == seq_len, "attention mask must be [B, ", seq_len,
                "], got ", key_mask->sizes());
    // [B, 1, 1, S]
    allowed = allowed.logical_and(key_mask->to(device).ne(0).unsqueeze(1).unsqueeze(1));
  }
  const double lowest = dtype == at::kBFloat16 ? -3.3895313892515355e38
                        : dtype == at::kHalf   ? -65504.0
                                               : static_cast<double>(std::numeric_limits<float>::lowest());
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  // [B or 1, 1, S, S]
  return at::zeros(allowed.sizes(), options).masked_fill_(allowed.logical_not(), lowest);
}

std::pair<at::Tensor, at::Tensor> joint_attention(const HeadsQKV& text, const HeadsQKV& image,
                                                  const RotaryEmbedding* text_rope,
                                                  const RotaryEmbedding* image_rope,
                                                  const std::optional<at::Tensor>& key_mask) {
  // RoPE is per position, so rotating each stream into its rows of the joint sequence equals
  // rotating the joint sequence with the joined tables.
  const int64_t text_len = text.query.size(1);
  const auto join = [&](const at::Tensor& t, const at::Tensor& i, bool rotate) {
    TORCH_CHECK(t.dim() == 4 && i.dim() == 4 && t.size(0) == i.size(0) && t.size(2) == i.size(2) &&
                    t.size(3) == i.size(3),
                "joint_attention: text ", t.sizes(), " and image ", i.sizes(), " must be [B, S, H, hd] alike");
    // [B, L + N, H_local, hd]: text first
    at::Tensor joint = empty_heads(t.size(0), t.size(1) + i.size(1), t.size(2), t.size(3), t.options());
    at::Tensor joint_text = joint.narrow(1, 0, text_len);
    at::Tensor joint_image = joint.narrow(1, text_len, i.size(1));
    if (rotate && text_rope != nullptr) {
      apply_rotary_emb_into(t, *text_rope, joint_text);
    } else {
      joint_text.copy_(t);
    }
    if (rotate && image_rope != nullptr) {
      apply_rotary_emb_into(i, *image_rope, joint_image);
    } else {
      joint_image.copy_(i);
    }
    return joint;
  };
  const HeadsQKV joint{join(text.query, image.query, true), join(text.key, image.key, true),
                       join(text.value, image.value, false)};
  std::optional<at::Tensor> mask;
  // [B, L + N] -> [B, 1, 1, L + N]: the same keys for every head and query
  if (key_mask.has_value() && key_mask->defined()) mask = key_mask->unsqueeze(1).unsqueeze(1);
  // [B, L + N, H_local * hd]
  const at::Tensor attended = attention(joint, nullptr, mask);
  return {attended.slice(1, 0, text_len), attended.slice(1, text_len)};
}

GELU::GELU(int64_t dim_in, int64_t dim_out, bool approximate_tanh, bool bias)
    : approximate_tanh_(approximate_tanh) {
  proj = register_module("proj", std::make_shared<Linear>(LinearOptions(dim_in, dim_out).with_bias(bias)));
}

at::Tensor GELU::forward(const at::Tensor& x) {
  if (approximate_tanh_) return proj->forward_gelu_tanh(x);
  at::Tensor h = proj->forward(x);
  return at::gelu_(h);
}

FeedForward::FeedForward(const FeedForwardOptions& options) {
  const int64_t inner_dim = options.inner_dim > 0 ? options.inner_dim : options.dim * options.mult;
  const int64_t dim_out = options.dim_out > 0 ? options.dim_out : options.dim;
  net = register_module("net", std::make_shared<Net>());
  net->act = net->add("0", std::make_shared<GELU>(options.dim, inner_dim, options.approximate_tanh, options.bias));
  net->linear = net->add("2", std::make_shared<Linear>(LinearOptions(inner_dim, dim_out).with_bias(options.bias)));
}

at::Tensor FeedForward::forward(const at::Tensor& x) {
  // [..., dim] -> [..., inner (local)] -> [..., dim_out]
  return net->linear->forward(net->act->forward(x));
}

}  // namespace shardit::nn
