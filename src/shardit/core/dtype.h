#pragma once
// Compute dtypes as users name them on command lines and in configs.
#include <c10/core/ScalarType.h>

#include <string>

namespace shardit {

/// "f32" / "fp32" / "float32" -> Float, "bf16" / "bfloat16" -> BFloat16. Anything else is an
/// error naming the value and the accepted names.
at::ScalarType parse_compute_dtype(const std::string& name);

}  // namespace shardit
