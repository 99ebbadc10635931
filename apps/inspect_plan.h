#pragma once
// `shardit inspect --plan`'s memory summary: per component and for the pipeline, parameters and
// bytes replicated / sharded / per rank under both plans, activation estimates, and a verdict per
// TP degree for a device size. Reads config.json files only.
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>

#include "shardit/io/model_folder.h"
#include "shardit/models/memory_plan.h"
#include "shardit/models/registry.h"
#include "shardit/nn/quantized_weight.h"
#include "shardit/parallel/plan.h"

namespace shardit::apps {

/// The registered class named `class_name`, of any kind, that builds a module (transformers,
/// text encoders, VAEs); null when there is none.
const models::ComponentClass* find_module_class(const std::string& class_name);


struct MemoryPlanRequest {
  int tp = 1;
  parallel::TpPlanKind plan = parallel::TpPlanKind::Full;
  at::ScalarType dtype = at::kFloat;
  /// The transformer's Linears in 8 bits (but its keep-high-precision ones), as --weights-dtype
  /// loads them; Checkpoint: all in `dtype`.
  nn::WeightsDtype weights = nn::WeightsDtype::Checkpoint;
  /// With a step shape: activation estimates of one transformer step and of the VAE decode.
  std::optional<models::StepShape> step;
  /// Device memory in GiB: a verdict per TP degree.
  std::optional<double> device_memory_gib;
  bool json = false;
  /// The text encoders' degree (--text-encoder-tp); unset: the largest divisor of `tp` that all
  /// of them allow, as a pipeline loads them.
  std::optional<int> text_encoder_tp;
  /// --transformer FILE: the transformer's weights counted as that file stores them and a load
  /// keeps them (GGUF blocks, FP8 Linears); "": as the plan counts the folder's.
  std::string transformer_file;
};

/// The degree a pipeline splits `folder`'s text encoders over when its transformer is at `tp`
/// (the largest divisor of `tp` that all of them allow); `tp` when it has none.
int text_encoder_degree(const io::ModelFolder& folder, int tp, at::ScalarType dtype);

/// Prints the summary of `folder` (one component or a pipeline) as text or JSON. Unknown classes,
/// config errors and TP degrees that cannot divide are the registry's and resolver's own errors;
/// in a pipeline, components of classes the registry does not build (tokenizers, schedulers,
/// text encoders not yet supported) are listed as not counted.
void print_memory_plan(const io::ModelFolder& folder, const MemoryPlanRequest& request);

}  // namespace shardit::apps
