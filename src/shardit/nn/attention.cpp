#include "shardit/nn/attention.h"
#include "shardit/core/profile.h"

#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "shardit/core/compat.h"

namespace shardit::nn {

namespace {

#if !SHARDIT_HAS_SDPA
// Scores for every head at once take B * H * S_q * S_kv floats: 2 GiB for FLUX.1 at 1024x1024
// (24 heads, 4608 tokens), 27 GiB at 2048x2048. Heads are processed in groups whose scores stay
// under this budget; each group is still one large batched matmul.
constexpr int64_t kScoresBudgetBytes = int64_t{256} << 20;

at::Tensor math_attention_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& mask, double scale) {
  // [B, h, S_q, S_kv]
  at::Tensor scores = at::matmul(q * scale, k.transpose(-2, -1));
  if (mask.has_value() && mask->defined()) {
    if (mask->scalar_type() == at::kBool) {
      scores = scores.to(at::kFloat).masked_fill(mask->logical_not(), -std::numeric_limits<float>::infinity());
    } else {
      scores = scores.to(at::kFloat) + mask->to(at::kFloat);
    }
  }
  // The softmax in fp32 whatever the input dtype, then back for the product with v.
  at::Tensor probs = at::softmax(scores, -1, at::kFloat);
  if (probs.scalar_type() != v.scalar_type()) probs = probs.to(v.scalar_type());
  // [B, h, S_q, D]
  return at::matmul(probs, v);
}

at::Tensor math_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double scale) {
  const int64_t heads = q.size(1);
  const int64_t bytes_per_head = q.size(0) * q.size(2) * k.size(2) * static_cast<int64_t>(sizeof(float));
  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(heads, kScoresBudgetBytes / std::max<int64_t>(1, bytes_per_head)));
  if (group >= heads) return math_attention_heads(q, k, v, mask, scale);
  // The heads dimension of a mask is its third from last ([H, S_q, S_kv] or [B, H, S_q, S_kv]); a
  // mask broadcast over heads (size 1 there, or fewer dimensions) applies to every group as it is.
  const bool mask_per_head = mask.has_value() && mask->defined() && mask->dim() >= 3 && mask->size(-3) > 1;
  std::vector<at::Tensor> outputs;
  for (int64_t h = 0; h < heads; h += group) {
    const int64_t n = std::min(group, heads - h);
    std::optional<at::Tensor> group_mask = mask;
    if (mask_per_head) group_mask = mask->narrow(mask->dim() - 3, h, n);
    outputs.push_back(math_attention_heads(q.narrow(1, h, n), k.narrow(1, h, n), v.narrow(1, h, n), group_mask, scale));
  }
  // [B, H, S_q, D]
  return at::cat(outputs, 1);
}
#endif

}  // namespace

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
  const double default_scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const double softmax_scale = scale.value_or(default_scale);
#if SHARDIT_HAS_SDPA
  // LibTorch picks its fused kernel (flash / memory-efficient / CPU flash) or its math path; all
  // accumulate the softmax in fp32 for reduced-precision inputs. The `scale` argument only
  // exists from 2.1 on, so a non-default scale is folded into q.
  c10::optional<at::Tensor> attn_mask;
  if (mask.has_value() && mask->defined()) attn_mask = *mask;
  const at::Tensor query = scale.has_value() ? q * (softmax_scale / default_scale) : q;
  return at::scaled_dot_product_attention(query, k, v, attn_mask);
#else
  return math_attention(q, k, v, mask, softmax_scale);
#endif
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

HeadsQKV with_rope(const HeadsQKV& qkv, const RotaryEmbedding* rope) {
  if (rope == nullptr) return qkv;
  return {apply_rotary_emb(qkv.query, *rope), apply_rotary_emb(qkv.key, *rope), qkv.value};
}

}  // namespace

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
  // [B, H_local, S, hd]
  const at::Tensor attended = scaled_dot_product_attention(
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
  // RoPE is per position, so rotating each stream before joining equals rotating the joint
  // sequence with the joined tables.
  const HeadsQKV txt = with_rope(text, text_rope);
  const HeadsQKV img = with_rope(image, image_rope);
  const int64_t text_len = txt.query.size(1);
  // [B, L + N, H_local, hd]: text first
  const HeadsQKV joint{at::cat({txt.query, img.query}, 1), at::cat({txt.key, img.key}, 1),
                       at::cat({txt.value, img.value}, 1)};
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
  at::Tensor h = proj->forward(x);
  return approximate_tanh_ ? at::gelu_(h, "tanh") : at::gelu_(h);
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
