#pragma once
// What sizes the activations of one transformer step, for the memory planner (memory_plan.h):
// the step's shape, and the live tensors of each phase of a model's blocks. Each transformer class
// describes its own blocks (JointTransformer2DModel::step_model), read from its block code.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shardit/nn/attention/backends.h"

namespace shardit::models {

/// The inputs of one step whose activations are estimated.
struct StepShape {
  int64_t height = 1024;  ///< image pixels
  int64_t width = 1024;
  int64_t batch = 1;
  int64_t text_tokens = 512;
  /// The attention backend the step is estimated for, by its registry name (nn/attention/):
  /// "math" materialises each head group's fp32 scores under scores_budget_bytes (at least one
  /// head per group); "memory_efficient" never holds more than one block of keys per query block.
  std::string attention_backend = "math";
  int64_t scores_budget_bytes = nn::kMathScoresBudgetBytes;
};

/// The live tensors of one phase of a block, in elements per token: `full` are [B, S, x] tensors
/// every rank holds whole (the residual stream, norms, outputs after the all-reduce), `local`
/// the ones split by the TP degree (projections to heads, MLP hidden).
struct Phase {
  int64_t tokens;
  int64_t full;
  int64_t local;
  bool attention = false;  ///< holds the attention scores too
};

/// What sizes a transformer step: the phases of its blocks and its attention.
struct StepModel {
  std::vector<Phase> phases;
  int64_t attention_tokens;  ///< the joint sequence attention runs over
  int64_t heads;
  int64_t head_dim;
};

/// Latent tokens of an image of `shape` with `pixels_per_token` pixels a side per token (8x VAE
/// downsampling, then the model's packing); an error unless both sides are positive multiples.
int64_t image_tokens(const StepShape& shape, int64_t pixels_per_token);

}  // namespace shardit::models
