#pragma once
// Memory planning from configs alone: parameters and bytes per rank of each component under a
// tensor-parallel plan, and estimates of the activation peak of one transformer step and of the
// VAE decode. Models are built on the meta device; nothing is allocated or read but config.json.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/models/activation_model.h"
#include "shardit/models/registry.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::models {

/// Parameter and byte counts of one component under one plan at one TP degree. Buffers are not
/// parameters but are counted in the bytes.
struct ComponentMemory {
  std::string component;   ///< "transformer", or the folder name
  std::string class_name;  ///< "FluxTransformer2DModel"
  std::string plan;        ///< "full", "reference", or "replicated" for a class without a plan
  int tp_degree = 1;
  int64_t parameters_total = 0;
  int64_t parameters_replicated = 0;  ///< held whole by every rank
  int64_t parameters_sharded = 0;     ///< full count of the sharded parameters
  int64_t per_rank_parameters = 0;    ///< the most any rank holds
  int64_t bytes_total = 0;
  int64_t per_rank_bytes = 0;         ///< the most any rank holds, in the chosen dtype
};

/// Counts of a resolved plan (the largest rank wins when slices are uneven).
ComponentMemory memory_of(const parallel::ResolvedPlan& resolved);

/// Peak bytes of the activations one rank holds during one forward of `model` (a transformer
/// class of the registry) at TP=`tp_degree`, in `dtype`: the live tensors of the block with the
/// largest working set (the model's own step_model), plus the attention scores of the chosen
/// backend. Weights not included. An error naming the class when it has no estimate, or the
/// backend when it has none.
int64_t transformer_step_activation_bytes(const parallel::TensorParallelModule& model, int tp_degree,
                                          at::ScalarType dtype, const StepShape& shape);

/// Peak bytes of the activations of decoding one batch of `shape` with the VAE whose config is
/// `config` (untiled, in `dtype`): the widest full-resolution stage and the mid-block attention.
int64_t vae_decode_activation_bytes(const nlohmann::json& config, const std::string& source, at::ScalarType dtype,
                                    const StepShape& shape);

}  // namespace shardit::models
