#include "shardit/parallel/plan.h"

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

}  // namespace shardit::parallel
