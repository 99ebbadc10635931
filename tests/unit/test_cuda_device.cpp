// On a CUDA device (a build with CUDA, on a machine with a GPU): shardit's products and attention
// give on the GPU what they give on the CPU. Elsewhere the cases skip, saying why: they count as
// skipped, never as passed.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "shardit/nn/attention.h"
#include "shardit/nn/gemm.h"
#include "support/test_support.h"

namespace test_cuda_device {
namespace {

#define SKIP_WITHOUT_CUDA_DEVICE()                                                                     \
  do {                                                                                                 \
    if (!SHARDIT_WITH_CUDA) GTEST_SKIP() << "needs a GPU: this build has no CUDA (LibTorch without it)"; \
    if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU: this machine has no CUDA device";                \
  } while (false)

TEST(CudaDevice, LinearMatchesTheCpu) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const at::Tensor x = at::randn({64, 256}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor w = at::randn({128, 256}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor b = at::randn({128}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor cpu = shardit::nn::linear(x, w, b);
  const at::Tensor gpu = shardit::nn::linear(x.cuda(), w.cuda(), b.cuda());
  ASSERT_TRUE(gpu.is_cuda());
  EXPECT_TRUE(shardit::testing::tensors_close("linear on cuda vs cpu", gpu.cpu(), cpu, 1e-4, 1e-4));
}

TEST(CudaDevice, AttentionMatchesTheCpu) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor q = at::randn({1, 4, 96, 64}, options);
  const at::Tensor k = at::randn({1, 4, 80, 64}, options);
  const at::Tensor v = at::randn({1, 4, 80, 64}, options);
  const at::Tensor cpu = shardit::nn::scaled_dot_product_attention(q, k, v);
  const at::Tensor gpu = shardit::nn::scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda());
  ASSERT_TRUE(gpu.is_cuda());
  EXPECT_TRUE(shardit::testing::tensors_close("attention on cuda vs cpu", gpu.cpu(), cpu, 1e-4, 1e-4));
}

#undef SKIP_WITHOUT_CUDA_DEVICE

}  // namespace
}  // namespace test_cuda_device
