// The golden transformers at TP=2 with every product on oneDNN (SHARDIT_GEMM_BACKEND=onednn in
// the ranks), against the TP=1 sample on LibTorch's BLAS path: the sharded products (colwise,
// rowwise partial sums, packed blocks, gathered modulation) and the per-head attention products
// must give the same result on either kernel.
//
// Tolerance: the golden one (1e-4 absolute + relative): TP reorders the rowwise sums and the
// kernels reorder each product's sums (~1e-6 of the scale); a sharding error moves values by O(1).
#include <gtest/gtest.h>

#include <ATen/Context.h>

#include <string>

#include "shardit/dist/world.h"
#include "shardit/io/safetensors.h"
#include "shardit/nn/gemm.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_tp_gemm {
namespace {

using shardit::testing::env_or;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;

constexpr double kTolerance = 1e-4;

void worker() {
  auto& world = shardit::dist::World::init();
  ASSERT_EQ(shardit::nn::gemm_backend_selection(), shardit::nn::GemmBackend::OneDnn);
  const std::string dir = env_or("SHARDIT_GEMM_MODEL");
  const at::Tensor sample = shardit::testing::run_case(*shardit::testing::load_transformer(dir, "shard-on-load"), dir);
  const at::Tensor reference = shardit::io::SafetensorsFile::open(env_or("SHARDIT_GEMM_REFERENCE"))->read("sample");
  EXPECT_TRUE(tensors_close(dir + " at TP=" + std::to_string(world.size()) + " on onednn vs TP=1 on blas", sample,
                            reference, kTolerance, kTolerance));
}

void expect_tp2_on_onednn(const std::string& golden_case) {
  if (!at::hasMKLDNN()) GTEST_SKIP() << "the linked LibTorch has no oneDNN";
  const std::string dir = golden_path(golden_case);
  at::Tensor reference;
  {
    shardit::nn::GemmBackendGuard blas(shardit::nn::GemmBackend::Blas);
    reference = shardit::testing::run_case(*shardit::testing::load_transformer(dir), dir);
  }
  const std::string path = shardit::testing::make_temp_dir("gemm-reference") + "/reference.safetensors";
  shardit::io::save_safetensors(path, {{"sample", reference}});
  EXPECT_EQ(run_ranks(2, {{"SHARDIT_GEMM_MODEL", dir}, {"SHARDIT_GEMM_REFERENCE", path},
                          {"SHARDIT_GEMM_BACKEND", "onednn"}}),
            0);
}

TEST(TpGemm, GoldenFluxTp2OnOneDnnMatchesTp1OnBlas) {
  if (is_worker()) return worker();
  expect_tp2_on_onednn("flux_b2_nonsquare");
}

TEST(TpGemm, GoldenFlux2KleinTp2OnOneDnnMatchesTp1OnBlas) {
  if (is_worker()) return worker();
  expect_tp2_on_onednn("flux2_klein_b2_nonsquare");
}

TEST(TpGemm, GoldenQwenImageTp2OnOneDnnMatchesTp1OnBlas) {
  if (is_worker()) return worker();
  expect_tp2_on_onednn("qwenimage_b2_nonsquare");
}

}  // namespace
}  // namespace test_tp_gemm
