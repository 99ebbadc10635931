#include "shardit/core/dtype.h"

#include <c10/util/Exception.h>

namespace shardit {

at::ScalarType parse_compute_dtype(const std::string& name) {
  if (name == "f32" || name == "fp32" || name == "float32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  TORCH_CHECK(false, "dtype '", name, "' is not supported; use f32 or bf16");
}

}  // namespace shardit
