#include "shardit/parallel/plan.h"

#include <c10/util/Exception.h>

namespace shardit::parallel {

const char* shard_style_name(ShardStyle style) {
  switch (style) {
    case ShardStyle::Colwise: return "Colwise";
    case ShardStyle::Rowwise: return "Rowwise";
    case ShardStyle::PackedColwise: return "PackedColwise";
    case ShardStyle::PackedRowwise: return "PackedRowwise";
    case ShardStyle::ColwiseGather: return "ColwiseGather";
  }
  return "?";
}

TpPlan with_sharded_modulation(const std::vector<std::string>& modulation_linears, const TpPlan& reference) {
  TpPlan plan;
  for (const std::string& pattern : modulation_linears) plan.push_back({pattern, ShardStyle::ColwiseGather});
  plan.insert(plan.end(), reference.begin(), reference.end());
  return plan;
}

const char* tp_plan_kind_name(TpPlanKind kind) {
  switch (kind) {
    case TpPlanKind::Full: return "full";
    case TpPlanKind::Reference: return "reference";
  }
  return "?";
}

TpPlanKind parse_tp_plan_kind(const std::string& name) {
  if (name == "full") return TpPlanKind::Full;
  if (name == "reference") return TpPlanKind::Reference;
  TORCH_CHECK(false, "unknown tensor-parallel plan '", name, "'; expected 'full' or 'reference'");
}

const char* sequence_stream_name(SequenceStream stream) {
  switch (stream) {
    case SequenceStream::Text: return "text";
    case SequenceStream::Image: return "image";
  }
  return "?";
}

}  // namespace shardit::parallel
