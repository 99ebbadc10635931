#pragma once
// Tensor-parallel plans as data (diffusers' `_tp_plan`): an ordered list of (module glob, style).
#include <cstdint>
#include <string>
#include <vector>

namespace shardit::parallel {

enum class ShardStyle {
  Colwise,        ///< weight dim 0 and bias split; output stays local
  Rowwise,        ///< weight dim 1 split; bias whole, added once after the all-reduce
  PackedColwise,  ///< dim 0 made of fused blocks, each split on its own
  PackedRowwise,  ///< dim 1 made of fused blocks, each split on its own
  ColwiseGather,  ///< colwise, output all-gathered back to full width (Megatron gather_output)
};
const char* shard_style_name(ShardStyle style);

/// Which of a model's plans to apply: `Full` is the model's own tp_plan() (modulation and the
/// other large linears sharded); `Reference` is the reference implementation's `_tp_plan`
/// verbatim (TensorParallelModule::reference_tp_plan), to reproduce its memory and outputs.
enum class TpPlanKind { Full, Reference };
/// "full", "reference".
const char* tp_plan_kind_name(TpPlanKind kind);
/// The kind named `name` ("full" or "reference"); an error naming `name` otherwise.
TpPlanKind parse_tp_plan_kind(const std::string& name);

/// One plan entry. `pattern` is a dotted module path with at most one `*`, standing for the
/// index in a module list ("transformer_blocks.*.attn.to_q"). For packed styles, `blocks` are
/// proportions of the fused dimension ({1, 1, 1} for q|k|v); empty means the layer declares the
/// absolute block sizes itself (LinearOptions::in_blocks/out_blocks), for fusions whose sizes
/// depend on the config.
struct PlanEntry {
  std::string pattern;
  ShardStyle style;
  std::vector<int64_t> blocks = {};
};

using TpPlan = std::vector<PlanEntry>;

/// A constraint that the sharded dimensions alone do not show, such as "heads must split
/// evenly": the TP degree must divide `value`.
struct TpDivisor {
  std::string what;  ///< "num_attention_heads"
  int64_t value;
};

}  // namespace shardit::parallel
