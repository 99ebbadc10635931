#pragma once
// Rotary position embeddings in the real cos/sin form that FLUX uses: each frequency is repeated
// for a channel pair (2k, 2k+1), and the pair is rotated by its angle.
#include <ATen/ATen.h>

#include <vector>

namespace shardit::nn {

/// cos and sin tables [S, head_dim] (fp32), each frequency repeated twice (interleaved), or, with
/// `rotate_half`, [S, head_dim] or [B, S, head_dim] in transformers' layout (cat[freqs, freqs]).
struct RotaryEmbedding {
  at::Tensor cos;
  at::Tensor sin;
  /// transformers' layout: channel j is paired with j + D/2 (rotate_half), not with its neighbour.
  bool rotate_half = false;

  /// The rows [begin, end) (positions of one part of a joint sequence), as views.
  RotaryEmbedding slice(int64_t begin, int64_t end) const {
    return {cos.slice(0, begin, end), sin.slice(0, begin, end), rotate_half};
  }
};

/// diffusers' get_1d_rotary_pos_embed(dim, pos, theta, use_real=True, repeat_interleave_real=True)
/// with float64 frequencies: freq_j = theta^(-2j/dim), angle = pos * freq_j in float64, cos/sin
/// cast to fp32. pos [S] -> cos, sin [S, dim].
RotaryEmbedding rotary_pos_embed_1d(int64_t dim, const at::Tensor& pos, double theta);

/// transformers' default rotary embedding (Llama, Qwen2/3, Qwen2.5-VL text): inv_freq_j =
/// 1 / theta^(2j/dim) and angle = pos * inv_freq_j, both in fp32 as transformers computes them;
/// tables cat[angles, angles] (rotate-half layout). positions (integer) [B, S] -> cos, sin
/// [B, S, dim] (fp32).
RotaryEmbedding rotary_pos_embed_rotate_half(int64_t dim, const at::Tensor& positions, double theta);

/// diffusers' FluxPosEmbed: one 1-D embedding per axis of the position ids, concatenated along
/// the channels. ids [S, n_axes] -> cos, sin [S, sum(axes_dim)].
class FluxPosEmbed {
 public:
  FluxPosEmbed(double theta, std::vector<int64_t> axes_dim);
  RotaryEmbedding forward(const at::Tensor& ids) const;
  const std::vector<int64_t>& axes_dim() const { return axes_dim_; }

 private:
  double theta_;
  std::vector<int64_t> axes_dim_;
};

/// diffusers' apply_rotary_emb(use_real=True, use_real_unbind_dim=-1) with the sequence on dim 1:
/// out[2k] = x[2k] cos - x[2k+1] sin, out[2k+1] = x[2k+1] cos + x[2k] sin, computed in fp32 and
/// cast back to x's dtype. x [B, S, H, D], cos/sin [S, D].
/// With `rope.rotate_half` (transformers' apply_rotary_pos_emb): x * cos + rotate_half(x) * sin,
/// rotate_half(x) = [-x2, x1] for the halves x1, x2 of D; cos/sin [S, D] or [B, S, D].
at::Tensor apply_rotary_emb(const at::Tensor& x, const RotaryEmbedding& rope);
/// apply_rotary_emb written into `out` (x's shape and dtype, e.g. a slice of a joint sequence's
/// buffer), so joining streams after RoPE needs no concatenation.
void apply_rotary_emb_into(const at::Tensor& x, const RotaryEmbedding& rope, at::Tensor out);

}  // namespace shardit::nn
