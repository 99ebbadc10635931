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
// The bounds below (5e-2 and 4e-2) leave about 3x margin for other seeds and shapes while still
// failing on a real error (a wrong modulation order, a dropped gate, a misplaced RoPE pair), which
// moves the sample by O(1) relative.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/nn/cpu/amx_gemm.h"
#include "shardit/nn/gemm.h"
#include "shardit/verify/transformer_case.h"
#include "support/test_support.h"

namespace shardit {
namespace test_transformers_bf16 {
namespace {

constexpr double kMaxRelToPeak = 5e-2;
constexpr double kRmsRel = 4e-2;

class TransformerBf16 : public ::testing::TestWithParam<std::string> {};

/// The bf16 model's sample on the golden inputs, checked against the fp32 golden; returned for more checks.
at::Tensor sample_close_to_golden(const std::string& name) {
  const std::string dir = testing::golden_path(name);
  const io::ComponentFolder folder = io::open_component(dir, "transformer");
  auto model = models::create_transformer(folder);
  parallel::LoadOptions options;
  options.dtype = at::kBFloat16;
  model->load(folder.weights(), options);
  for (const auto& parameter : model->named_parameters()) {
    EXPECT_EQ(parameter.tensor->scalar_type(), at::kBFloat16) << parameter.name;
  }

  const at::Tensor sample =
      verify::forward_from_file(*model, *io::SafetensorsFile::open(dir + "/inputs.safetensors"));
  EXPECT_EQ(sample.scalar_type(), at::kBFloat16);

  const at::Tensor expected = io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample").to(at::kDouble);
  EXPECT_EQ(sample.sizes(), expected.sizes());
  if (sample.sizes() != expected.sizes()) return sample;
  const at::Tensor diff = sample.to(at::kDouble) - expected;
  const double peak = expected.abs().max().item<double>();
  const double max_rel = diff.abs().max().item<double>() / peak;
  const double rms_rel = std::sqrt(diff.pow(2).mean().item<double>() / expected.pow(2).mean().item<double>());
  std::cout << name << " (gemm " << nn::gemm_backend_name(nn::gemm_backend_selection())
            << "): bf16 vs fp32 golden: max |diff| / max |ref| = " << max_rel << ", relative rms = " << rms_rel << "\n";
  EXPECT_LE(max_rel, kMaxRelToPeak);
  EXPECT_LE(rms_rel, kRmsRel);
  // And clearly not identical to fp32: the test would otherwise not be exercising bf16.
  EXPECT_GT(rms_rel, 1e-5);
  return sample;
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

INSTANTIATE_TEST_SUITE_P(Golden, TransformerBf16,
                         ::testing::Values("flux_b1_square", "flux_b2_nonsquare", "flux_schnell_b2_nonsquare",
                                           "flux2_b1_square", "flux2_b2_nonsquare", "flux2_klein_b2_nonsquare",
                                           "qwenimage_b1_square", "qwenimage_b2_nonsquare"));

}  // namespace
}  // namespace test_transformers_bf16
}  // namespace shardit
