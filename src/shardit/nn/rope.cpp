#include "shardit/nn/rope.h"

#include "shardit/nn/cpu/fused.h"

#include <c10/util/Exception.h>

#include <numeric>
#include <vector>
#include <utility>

namespace shardit::nn {

RotaryEmbedding rotary_pos_embed_1d(int64_t dim, const at::Tensor& pos, double theta) {
  TORCH_CHECK(dim > 0 && dim % 2 == 0, "rotary embedding: axis dimension must be positive and even, got ", dim);
  TORCH_CHECK(pos.dim() == 1, "rotary embedding: positions must be 1-D [S], got shape ", pos.sizes());
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(pos.device());
  // [dim/2]: theta^(-2j/dim) in float64
  const at::Tensor freqs = 1.0 / at::pow(theta, at::arange(0, dim, 2, f64) / static_cast<double>(dim));
  // [S, dim/2]
  const at::Tensor angles = at::outer(pos.to(at::kDouble), freqs);
  // [S, dim]: each frequency twice, (2k, 2k+1)
  return {angles.cos().repeat_interleave(2, 1).to(at::kFloat),
          angles.sin().repeat_interleave(2, 1).to(at::kFloat)};
}

RotaryEmbedding rotary_pos_embed_rotate_half(int64_t dim, const at::Tensor& positions, double theta) {
  TORCH_CHECK(dim > 0 && dim % 2 == 0, "rotary embedding: head dimension must be positive and even, got ", dim);
  TORCH_CHECK(positions.dim() == 2 && !at::isFloatingType(positions.scalar_type()),
              "rotary embedding: positions must be integer [B, S], got ", positions.scalar_type(), " ",
              positions.sizes());
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(positions.device());
  // [dim/2], fp32 as transformers' _compute_default_rope_parameters
  const at::Tensor inv_freq = 1.0 / at::pow(theta, at::arange(0, dim, 2, f32.dtype(at::kLong)).to(at::kFloat) /
                                                       static_cast<double>(dim));
  // [B, S, dim/2]
  const at::Tensor angles = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;
  // [B, S, dim]
  const at::Tensor emb = at::cat({angles, angles}, -1);
  return {emb.cos(), emb.sin(), /*rotate_half=*/true};
}

FluxPosEmbed::FluxPosEmbed(double theta, std::vector<int64_t> axes_dim)
    : theta_(theta), axes_dim_(std::move(axes_dim)) {
  TORCH_CHECK(!axes_dim_.empty(), "FluxPosEmbed: axes_dim must not be empty");
}

RotaryEmbedding FluxPosEmbed::forward(const at::Tensor& ids) const {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == static_cast<int64_t>(axes_dim_.size()),
              "FluxPosEmbed: position ids have shape ", ids.sizes(), ", expected [S, ", axes_dim_.size(),
              "] (one column per entry of axes_dims_rope)");
  const at::Tensor pos = ids.to(at::kFloat);
  std::vector<at::Tensor> cos_parts;
  std::vector<at::Tensor> sin_parts;
  for (size_t i = 0; i < axes_dim_.size(); ++i) {
    RotaryEmbedding axis = rotary_pos_embed_1d(axes_dim_[i], pos.select(1, static_cast<int64_t>(i)), theta_);
    cos_parts.push_back(std::move(axis.cos));
    sin_parts.push_back(std::move(axis.sin));
  }
  // [S, sum(axes_dim)]
  return {at::cat(cos_parts, 1), at::cat(sin_parts, 1)};
}

namespace {

at::Tensor apply_rotary_emb_rotate_half(const at::Tensor& x, const RotaryEmbedding& rope) {
  const int64_t batch = x.size(0);
  const int64_t seq = x.size(1);
  const int64_t head_dim = x.size(3);
  const bool batched = rope.cos.dim() == 3;
  TORCH_CHECK((rope.cos.dim() == 2 || (batched && (rope.cos.size(0) == batch || rope.cos.size(0) == 1))) &&
                  rope.cos.size(-2) == seq && rope.cos.size(-1) == head_dim && rope.sin.sizes() == rope.cos.sizes(),
              "apply_rotary_emb: cos/sin have shape ", rope.cos.sizes(), " and ", rope.sin.sizes(), ", expected [",
              seq, ", ", head_dim, "] or [", batch, ", ", seq, ", ", head_dim, "] to match x of shape ", x.sizes());
  const at::Tensor x32 = x.to(at::kFloat);
  // [B or 1, S, 1, D]
  const at::Tensor cos = (batched ? rope.cos : rope.cos.unsqueeze(0)).unsqueeze(2);
  const at::Tensor sin = (batched ? rope.sin : rope.sin.unsqueeze(0)).unsqueeze(2);
  const std::vector<at::Tensor> halves = x32.chunk(2, -1);
  // [B, S, H, D]: [-x2, x1]
  const at::Tensor rotated = at::cat({halves[1].neg(), halves[0]}, -1);
  return (x32 * cos + rotated * sin).to(x.scalar_type());
}

}  // namespace

void apply_rotary_emb_into(const at::Tensor& x, const RotaryEmbedding& rope, at::Tensor out) {
  TORCH_CHECK(x.dim() == 4, "apply_rotary_emb: x must be [B, S, H, D], got shape ", x.sizes());
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "apply_rotary_emb: out is ",
              out.scalar_type(), " ", out.sizes(), ", expected x's ", x.scalar_type(), " ", x.sizes());
  if (rope.rotate_half) {
    out.copy_(apply_rotary_emb_rotate_half(x, rope));
    return;
  }
  if (cpu::try_rope_interleaved(x, rope.cos, rope.sin, out)) return;
  const int64_t seq = x.size(1);
  const int64_t head_dim = x.size(3);
  TORCH_CHECK(rope.cos.dim() == 2 && rope.cos.size(0) == seq && rope.cos.size(1) == head_dim &&
                  rope.sin.sizes() == rope.cos.sizes(),
              "apply_rotary_emb: cos/sin have shape ", rope.cos.sizes(), " and ", rope.sin.sizes(),
              ", expected [", seq, ", ", head_dim, "] to match x of shape ", x.sizes());
  // [1, S, 1, D/2]: the repeated tables hold one value per pair
  const at::Tensor cos = rope.cos.slice(1, 0, head_dim, 2).unsqueeze(1).unsqueeze(0);
  const at::Tensor sin = rope.sin.slice(1, 0, head_dim, 2).unsqueeze(1).unsqueeze(0);
  // [B, S, H, D/2, 2]
  const at::Tensor pairs = x.unflatten(-1, {head_dim / 2, 2});
  const at::Tensor x_even = pairs.select(-1, 0);
  const at::Tensor x_odd = pairs.select(-1, 1);
  if (x.scalar_type() != at::kFloat) {
    // fp32 arithmetic, one rounding to x's dtype at the end.
    const at::Tensor even32 = x_even.to(at::kFloat), odd32 = x_odd.to(at::kFloat);
    out.copy_(at::stack({even32 * cos - odd32 * sin, odd32 * cos + even32 * sin}, -1).flatten(-2));
    return;
  }
  // fp32: written in place, no temporaries. [B, S, H, D/2] views of out
  const at::Tensor out_pairs = out.unflatten(-1, {head_dim / 2, 2});
  at::Tensor out_even = out_pairs.select(-1, 0);
  at::Tensor out_odd = out_pairs.select(-1, 1);
  at::mul_out(out_even, x_even, cos).addcmul_(x_odd, sin, -1);
  at::mul_out(out_odd, x_odd, cos).addcmul_(x_even, sin);
}

at::Tensor apply_rotary_emb(const at::Tensor& x, const RotaryEmbedding& rope) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  apply_rotary_emb_into(x, rope, out);
  return out;
}

}  // namespace shardit::nn
