#include "shardit/nn/timestep_embeddings.h"

#include <c10/util/Exception.h>

#include <cmath>

#if SHARDIT_WITH_SLEEF
#include <sleef.h>
#endif

namespace shardit::nn {

at::Tensor timestep_frequencies(int64_t num_channels, double downscale_freq_shift, double max_period) {
  TORCH_CHECK(num_channels >= 2, "timestep embedding: num_channels must be >= 2, got ", num_channels);
  const int64_t half = num_channels / 2;
  TORCH_CHECK(static_cast<double>(half) != downscale_freq_shift,
              "timestep embedding: downscale_freq_shift (", downscale_freq_shift,
              ") must differ from num_channels / 2 (", half, ")");
  // fp32 throughout, as the reference: fl32(fl32(-ln P) * k) / (half - shift), then torch's exp.
  const at::Tensor k = at::arange(half, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor exponent = (k * static_cast<float>(-std::log(max_period))) /
                              static_cast<float>(static_cast<double>(half) - downscale_freq_shift);
#if SHARDIT_WITH_SLEEF
  // The exp a LibTorch without MKL computes (Debian's; the torch the references were made with):
  // Sleef's expf within 1.0 ULP, whose scalar form gives the bits of the vector forms LibTorch
  // calls. A LibTorch with MKL
  // (PyPI's) takes MKL's vsExp instead, whose last bit differs for some entries, and the sinusoid
  // multiplies the entry by timesteps of up to ~1000 (guidance x 1000 in FLUX.2): one ulp of a
  // frequency moves sin/cos by ~1e-4. Computing the table here gives it the same bits on either
  // LibTorch.
  at::Tensor freqs = at::empty_like(exponent);
  const float* in = exponent.data_ptr<float>();
  float* out = freqs.data_ptr<float>();
  for (int64_t i = 0; i < half; ++i) out[i] = Sleef_expf_u10(in[i]);
  return freqs;
#else
  return at::exp(exponent);
#endif
}

Timesteps::Timesteps(const TimestepsOptions& options)
    : options_(options), freqs_(timestep_frequencies(options.num_channels, options.downscale_freq_shift)) {}

at::Tensor Timesteps::forward(const at::Tensor& timesteps) const {
  TORCH_CHECK(timesteps.dim() == 1, "Timesteps: timesteps must be 1-D [B], got shape ", timesteps.sizes());
  // [B, C/2]
  at::Tensor arg = timesteps.to(at::kFloat).unsqueeze(1) * freqs_.to(timesteps.device()).unsqueeze(0);
  if (options_.scale != 1.0) arg = arg * options_.scale;
  // [B, C]
  at::Tensor emb = options_.flip_sin_to_cos ? at::cat({at::cos(arg), at::sin(arg)}, -1)
                                            : at::cat({at::sin(arg), at::cos(arg)}, -1);
  if (options_.num_channels % 2 == 1) emb = at::constant_pad_nd(emb, {0, 1});
  return emb;
}

TimestepEmbedding::TimestepEmbedding(int64_t in_channels, int64_t time_embed_dim, bool bias) {
  linear_1 = register_module("linear_1", std::make_shared<Linear>(LinearOptions(in_channels, time_embed_dim).with_bias(bias)));
  linear_2 =
      register_module("linear_2", std::make_shared<Linear>(LinearOptions(time_embed_dim, time_embed_dim).with_bias(bias)));
}

at::Tensor TimestepEmbedding::forward(const at::Tensor& sample) {
  return linear_2->forward(at::silu(linear_1->forward(sample)));
}

PixArtAlphaTextProjection::PixArtAlphaTextProjection(int64_t in_features, int64_t hidden_size) {
  linear_1 = register_module("linear_1", std::make_shared<Linear>(LinearOptions(in_features, hidden_size)));
  linear_2 = register_module("linear_2", std::make_shared<Linear>(LinearOptions(hidden_size, hidden_size)));
}

at::Tensor PixArtAlphaTextProjection::forward(const at::Tensor& caption) {
  return linear_2->forward(at::silu(linear_1->forward(caption)));
}

}  // namespace shardit::nn
