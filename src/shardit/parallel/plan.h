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

/// A model's own plan from the reference's: `reference` (diffusers' `_tp_plan`, which keeps the
/// AdaLN modulation whole on every rank) with the modulation linears `modulation_linears` (module
/// globs) added first, split colwise and all-gathered back to full width (ColwiseGather). The
/// modulation is a large share of a DiT's weights and each block reads it at full width.
TpPlan with_sharded_modulation(const std::vector<std::string>& modulation_linears, const TpPlan& reference);

/// A constraint that the sharded dimensions alone do not show, such as "heads must split
/// evenly": the TP degree must divide `value`.
struct TpDivisor {
  std::string what;  ///< "num_attention_heads"
  int64_t value;
};

// ---------------------------------------------------------------------------------------------
// Context-parallel plans (diffusers' `_cp_plan`): which tensors of a forward are split along the
// sequence and where the output is gathered. A model's forward names its points
// (ContextParallelForward::point, parallel/context_parallel.h); the plan says what each does.

/// The sequence a split tensor belongs to. Tensors of one stream are split alike (the same
/// padding, the same shard per rank), so tokens keep their rotary rows and mask entries.
/// Joint sequences are [text; image], as nn::joint_attention lays them out.
enum class SequenceStream { Text, Image };
const char* sequence_stream_name(SequenceStream stream);

/// What a context-parallel point does with its tensor.
enum class CpAction {
  Split,   ///< pad `dim` to a multiple of the CP degree (zeros; masked as keys), keep this rank's chunk
  Gather,  ///< all-gather `dim` over the CP ranks and strip the padding
};

/// One plan entry: the point named `point` in the model's forward.
struct CpPlanEntry {
  std::string point;
  CpAction action;
  int64_t dim;  ///< the sequence dimension of the tensor at that point
  SequenceStream stream;
  /// The forward may skip the point (an optional input); otherwise every Split point must be
  /// reached before the gather.
  bool optional = false;
};

using CpPlan = std::vector<CpPlanEntry>;

}  // namespace shardit::parallel
