#pragma once
// Timestep and conditioning embeddings shared by the diffusers transformers (embeddings.py).
#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "shardit/nn/activations.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"

namespace shardit::nn {

/// The fp32 frequency table of diffusers' get_timestep_embedding: for k < C/2,
/// freqs[k] = exp(-ln(max_period) * k / (C/2 - downscale_freq_shift)) ([C/2]).
at::Tensor timestep_frequencies(int64_t num_channels, double downscale_freq_shift,
                                double max_period = 10000.0);

struct TimestepsOptions {
  TimestepsOptions(int64_t num_channels, bool flip_sin_to_cos, double downscale_freq_shift)
      : num_channels(num_channels), flip_sin_to_cos(flip_sin_to_cos), downscale_freq_shift(downscale_freq_shift) {}
  int64_t num_channels;
  bool flip_sin_to_cos;
  double downscale_freq_shift;
  double scale = 1.0;
};

/// diffusers' Timesteps (get_timestep_embedding), parameter free: arg = scale * (t * freqs[k]) in
/// fp32, and the result is [sin(arg), cos(arg)], or [cos(arg), sin(arg)] with flip_sin_to_cos; an
/// odd C is zero padded.
class Timesteps {
 public:
  explicit Timesteps(const TimestepsOptions& options);
  /// timesteps [B] (any real dtype; used as fp32) -> [B, num_channels] fp32.
  at::Tensor forward(const at::Tensor& timesteps) const;

 private:
  TimestepsOptions options_;
  at::Tensor freqs_;  // [num_channels / 2] fp32, computed once
};

/// diffusers' TimestepEmbedding with act_fn "silu": linear_2(silu(linear_1(x))). `bias`:
/// diffusers' sample_proj_bias (FLUX.2 has none).
class TimestepEmbedding : public Module {
 public:
  TimestepEmbedding(int64_t in_channels, int64_t time_embed_dim, bool bias = true);
  std::string type_name() const override { return "TimestepEmbedding"; }
  /// [B, in_channels] -> [B, time_embed_dim].
  at::Tensor forward(const at::Tensor& sample);

  std::shared_ptr<Linear> linear_1;
  std::shared_ptr<Linear> linear_2;
};

/// diffusers' PixArtAlphaTextProjection: linear_2(act_1(linear_1(caption))).
class PixArtAlphaTextProjection : public Module {
 public:
  PixArtAlphaTextProjection(int64_t in_features, int64_t hidden_size);
  std::string type_name() const override { return "PixArtAlphaTextProjection"; }
  /// [..., in_features] -> [..., hidden_size].
  at::Tensor forward(const at::Tensor& caption);

  std::shared_ptr<Linear> linear_1;
  std::shared_ptr<Linear> linear_2;
};

}  // namespace shardit::nn
