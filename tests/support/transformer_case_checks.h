#pragma once
// The golden transformer cases checked on any device and in either dtype: the fp32 parity suite
// (tests/parity), the bf16 suite (tests/unit) and the CUDA suite (tests/gpu) run the same checks,
// with the same tolerances, only the load options differ.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "shardit/parallel/tensor_parallel.h"

namespace shardit::testing {

/// The golden transformer cases (tests/golden/<name>): every family, batch 1 and 2, square and not.
const std::vector<std::string>& golden_transformer_cases();

/// fp32: loads the case's transformer with `options` (their dtype must be fp32), runs the golden
/// inputs, and checks the sample and every intermediate diffusers recorded within
/// 1e-4 + 1e-4·|expected| (golden README: the reference's own fp32-vs-fp64 spread is <= 2.3e-6).
void expect_sample_and_intermediates_match(const std::string& case_name, const parallel::LoadOptions& options);

/// bf16: loads the case's transformer with `options` (dtype bf16), checks every parameter is bf16,
/// and the sample against diffusers' fp32 sample: max |diff| <= 5e-2 of max |expected| and
/// relative RMS <= 4e-2 (measured 0.55e-2..1.39e-2 on these cases, tests/unit/test_transformers_bf16.cpp),
/// and clearly not fp32 (relative RMS > 1e-5). Returns the sample.
at::Tensor expect_bf16_sample_close_to_golden(const std::string& case_name, const parallel::LoadOptions& options);

}  // namespace shardit::testing
