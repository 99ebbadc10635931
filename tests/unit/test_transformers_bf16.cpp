// The transformers in bf16 (weights and activations; norms, softmax and RoPE in fp32) against the
// fp32 golden sample of diffusers.
//
// bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3 per operation): every weight is
// rounded once, and the roundings of ~60 activations along the residual stream add up. Measured on
// the golden cases (max over the sample of |bf16 - fp32| relative to max |fp32|; relative RMS
// error), in line with the golden README's "~1e-2 relative" for bf16:
//   flux_b1_square             max 1.39e-2, rms 1.31e-2
//   flux_b2_nonsquare          max 1.28e-2, rms 1.10e-2
//   flux_schnell_b2_nonsquare  max 0.90e-2, rms 0.81e-2
//   flux2_b1_square            max 1.22e-2, rms 0.92e-2
//   flux2_b2_nonsquare         max 0.68e-2, rms 0.74e-2
//   flux2_klein_b2_nonsquare   max 0.87e-2, rms 0.63e-2
//   qwenimage_b1_square        max 0.63e-2, rms 0.55e-2
//   qwenimage_b2_nonsquare     max 0.62e-2, rms 0.55e-2
// (reordering equivalent bf16 ops moves these by ~15%).
// The bounds (5e-2 and 4e-2, support/transformer_case_checks.h) leave about 3x margin for other seeds and shapes while still
// failing on a real error (a wrong modulation order, a dropped gate, a misplaced RoPE pair), which
// moves the sample by O(1) relative.
#include <gtest/gtest.h>

#include <string>

#include "shardit/nn/cpu/amx_gemm.h"
#include "shardit/nn/gemm.h"
#include "support/test_support.h"
#include "support/transformer_case_checks.h"

namespace shardit {
namespace test_transformers_bf16 {
namespace {

class TransformerBf16 : public ::testing::TestWithParam<std::string> {};

/// The bf16 model's sample on the golden inputs, checked against the fp32 golden.
at::Tensor sample_close_to_golden(const std::string& name) {
  parallel::LoadOptions options;
  options.dtype = at::kBFloat16;
  return testing::expect_bf16_sample_close_to_golden(name, options);
}

TEST_P(TransformerBf16, StaysCloseToTheFp32Golden) { sample_close_to_golden(GetParam()); }

// Every Linear whose widths the AMX kernel takes on it (the golden models' widths are multiples
// of 32 but for a few embedders). Where the CPU has no AMX-BF16 the selection must be refused.
TEST_P(TransformerBf16, StaysCloseOnTheAmxKernel) {
  if (!nn::cpu::amx_gemm_available()) {
    EXPECT_THROW(nn::set_gemm_backend(nn::GemmBackend::Amx), c10::Error);
    return;
  }
  // That the model's Linears reach the kernel under amx is test_gemm's (AmxGemm: nn::linear and
  // the Linear layer give the kernel's bits); here, that its sums keep diffusers' numbers.
  nn::GemmBackendGuard guard(nn::GemmBackend::Amx);
  sample_close_to_golden(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Golden, TransformerBf16, ::testing::ValuesIn(testing::golden_transformer_cases()));

}  // namespace
}  // namespace test_transformers_bf16
}  // namespace shardit
