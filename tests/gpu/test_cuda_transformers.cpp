// The golden transformer cases on a CUDA device, TP=1: the same checks and tolerances as on the
// CPU (fp32: the sample and every intermediate, tests/parity/test_parity_transformers.cpp; bf16:
// the sample against the fp32 golden, tests/unit/test_transformers_bf16.cpp). Where this build or
// machine has no CUDA device every case is skipped, saying which (scripts/gpu_check.sh runs this
// file on a GPU machine and fails when a case was skipped there).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "support/transformer_case_checks.h"

namespace shardit {
namespace test_cuda_transformers {
namespace {

/// Empty when a CUDA device can take the cases; else why not.
std::string why_no_cuda_device() {
#if SHARDIT_WITH_CUDA
  if (!at::hasCUDA()) return "this LibTorch has CUDA, but no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)";
  return "";
#else
  return "this build's LibTorch has no CUDA (build against a CUDA LibTorch: docs/building.md)";
#endif
}

parallel::LoadOptions on_first_cuda_device(at::ScalarType dtype) {
  parallel::LoadOptions options;
  options.dtype = dtype;
  options.device = at::Device(at::kCUDA, 0);
  return options;
}

class CudaTransformer : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string reason = why_no_cuda_device();
    if (!reason.empty()) GTEST_SKIP() << reason;
  }
};

TEST_P(CudaTransformer, Fp32SampleAndEveryIntermediateMatchDiffusers) {
  testing::expect_sample_and_intermediates_match(GetParam(), on_first_cuda_device(at::kFloat));
}

TEST_P(CudaTransformer, Bf16SampleStaysCloseToTheFp32Golden) {
  testing::expect_bf16_sample_close_to_golden(GetParam(), on_first_cuda_device(at::kBFloat16));
}

INSTANTIATE_TEST_SUITE_P(Golden, CudaTransformer, ::testing::ValuesIn(testing::golden_transformer_cases()));

}  // namespace
}  // namespace test_cuda_transformers
}  // namespace shardit
