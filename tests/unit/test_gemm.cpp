// The GEMM kernels behind nn's products (nn/gemm.h): oneDNN against LibTorch's BLAS path on
// random shapes (3-D inputs, no bias, odd widths, strided head views, one row), the Linear
// layer's paths, the math attention, auto's size rule and probe, the CLI option, and the golden
// transformers with every product on oneDNN.
//
// Tolerances: the two kernels differ only in the order of fp32 sums: ~1e-7 relative per sum of
// K terms, so 1e-5 absolute + relative on O(1) values and 1e-4 on the golden samples (the golden
// README's fp32 tolerance). A wrong transpose, bias or block offset moves values by O(1).
#include <gtest/gtest.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "shardit/io/safetensors.h"
#include "shardit/nn/activations.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/nn/attention/memory_efficient.h"
#include "shardit/core/cpu_features.h"
#include "shardit/nn/cpu/amx_gemm.h"
#include "shardit/nn/cpu/blas_core.h"
#include "shardit/nn/cpu/growing_buffer.h"
#include "shardit/nn/gemm.h"
#include "shardit/nn/linear.h"
#include "support/test_support.h"

namespace test_gemm {
namespace {

using shardit::nn::GemmBackend;
using shardit::nn::GemmBackendGuard;
using shardit::testing::error_of;
using shardit::testing::tensors_close;

constexpr double kTolerance = 1e-5;
constexpr double kGoldenTolerance = 1e-4;

template <typename Fn>
at::Tensor on(GemmBackend backend, Fn&& fn) {
  GemmBackendGuard guard(backend);
  return fn();
}

class Gemm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasMKLDNN()) GTEST_SKIP() << "the linked LibTorch has no oneDNN";
  }
};

TEST_F(Gemm, OneDnnLinearMatchesBlasOnRandomShapes) {
  at::manual_seed(3);
  struct Case {
    std::vector<int64_t> x_sizes;
    int64_t out;
    bool bias;
  };
  const std::vector<Case> cases = {{{1, 37}, 53, true},   {{5, 64}, 128, false},      {{2, 150, 96}, 70, true},
                                   {{3, 1, 7, 33}, 9, true}, {{300, 257}, 129, false}};
  for (const Case& c : cases) {
    const at::Tensor x = at::randn(c.x_sizes);
    const at::Tensor w = at::randn({c.out, c.x_sizes.back()}) / 8;
    const at::Tensor b = c.bias ? at::randn({c.out}) : at::Tensor();
    const at::Tensor blas = on(GemmBackend::Blas, [&] { return shardit::nn::linear(x, w, b); });
    const at::Tensor dnn = on(GemmBackend::OneDnn, [&] { return shardit::nn::linear(x, w, b); });
    EXPECT_EQ(dnn.sizes(), blas.sizes());
    EXPECT_TRUE(tensors_close("linear " + std::to_string(c.out), dnn, blas, kTolerance, kTolerance));
    EXPECT_TRUE(tensors_close("blas vs at::linear", blas, at::linear(x, w, b), 0, 0));
  }
  // A non-contiguous weight (a transposed view) and input (a column slice).
  const at::Tensor wt = at::randn({40, 24}).t();
  const at::Tensor xs = at::randn({90, 50}).narrow(1, 3, 40);
  EXPECT_TRUE(tensors_close("strided", on(GemmBackend::OneDnn, [&] { return shardit::nn::linear(xs, wt); }),
                            at::linear(xs, wt), kTolerance, kTolerance));
  // No rows: an empty result of the right shape.
  EXPECT_EQ(on(GemmBackend::OneDnn, [&] { return shardit::nn::linear(at::randn({0, 8}), at::randn({4, 8})); }).sizes(),
            (std::vector<int64_t>{0, 4}));
}

TEST_F(Gemm, OneDnnBatchedProductsMatchBmmOnHeadViews) {
  at::manual_seed(4);
  // [B, S, H, D] storage seen as [B * H, S, D], as the attention passes heads.
  const at::Tensor q = at::randn({1, 97, 3, 16}).transpose(1, 2).reshape({3, 97, 16});
  const at::Tensor k = at::randn({1, 130, 3, 16}).transpose(1, 2).reshape({3, 130, 16});
  const at::Tensor v = at::randn({3, 130, 16});
  const at::Tensor scores = on(GemmBackend::OneDnn, [&] { return shardit::nn::bmm_nt(q, k); });
  EXPECT_TRUE(tensors_close("a b^T", scores, at::bmm(q, k.transpose(1, 2)), kTolerance, kTolerance));
  const at::Tensor probs = at::softmax(scores, -1);
  EXPECT_TRUE(tensors_close("a b", on(GemmBackend::OneDnn, [&] { return shardit::nn::bmm_nn(probs, v); }),
                            at::bmm(probs, v), kTolerance, kTolerance));
  EXPECT_NE(error_of([&] { shardit::nn::bmm_nt(q, v.narrow(2, 0, 8)); }).find("expected a [G, M, K] and b [G, N, K]"),
            std::string::npos);
}

TEST_F(Gemm, LinearLayerPathsAgreeOnBothKernels) {
  at::manual_seed(5);
  shardit::nn::Linear layer(shardit::nn::LinearOptions(48, 20).with_in_blocks({16, 32}));
  layer.weight = at::randn({20, 48}) / 7;
  layer.bias = at::randn({20});
  const at::Tensor a = at::randn({2, 70, 16}), b = at::randn({2, 70, 32});
  const at::Tensor whole = at::cat({a, b}, -1);
  const at::Tensor reference = on(GemmBackend::Blas, [&] { return layer.forward(whole); });
  EXPECT_TRUE(tensors_close("blocks on blas", on(GemmBackend::Blas, [&] { return layer.forward_blocks({a, b}); }),
                            reference, kTolerance, kTolerance));
  EXPECT_TRUE(tensors_close("forward on onednn", on(GemmBackend::OneDnn, [&] { return layer.forward(whole); }),
                            reference, kTolerance, kTolerance));
  EXPECT_TRUE(tensors_close("blocks on onednn", on(GemmBackend::OneDnn, [&] { return layer.forward_blocks({a, b}); }),
                            reference, kTolerance, kTolerance));
}

TEST_F(Gemm, AttentionBackendsOnOneDnnMatchBlasWithMasks) {
  at::manual_seed(6);
  // Heads as the transformers pass them: [B, H, S, D] views of [B, S, H, D].
  const at::Tensor q = at::randn({2, 70, 3, 32}).transpose(1, 2), k = at::randn({2, 90, 3, 32}).transpose(1, 2),
                   v = at::randn({2, 90, 3, 32}).transpose(1, 2);
  at::Tensor keys = at::rand({2, 1, 1, 90}) > 0.3;
  keys.select(-1, 0).fill_(true);
  at::Tensor per_query = at::rand({2, 3, 70, 90}) > 0.5;
  per_query.select(-1, 89).fill_(true);
  const std::vector<std::optional<at::Tensor>> masks = {std::nullopt, keys, per_query, at::randn({3, 1, 90})};
  for (const std::string backend : {"math", "memory_efficient"}) {
    shardit::nn::AttentionBackendGuard guard(backend);
    for (size_t i = 0; i < masks.size(); ++i) {
      const auto& mask = masks[i];
      const at::Tensor blas = on(GemmBackend::Blas, [&] { return shardit::nn::scaled_dot_product_attention(q, k, v, mask); });
      const at::Tensor dnn = on(GemmBackend::OneDnn, [&] { return shardit::nn::scaled_dot_product_attention(q, k, v, mask); });
      EXPECT_TRUE(tensors_close(backend + ", mask " + std::to_string(i), dnn, blas, kTolerance, kTolerance));
    }
  }
  // Uneven streamed blocks (the last key and query blocks short), with the log-sum-exp.
  shardit::nn::MemoryEfficientOptions blocks;
  blocks.key_block = 32;
  blocks.query_block = 48;
  const auto blas = [&] {
    GemmBackendGuard g(GemmBackend::Blas);
    return shardit::nn::memory_efficient_attention(q, k, v, keys, 0.2, blocks);
  }();
  const auto dnn = [&] {
    GemmBackendGuard g(GemmBackend::OneDnn);
    return shardit::nn::memory_efficient_attention(q, k, v, keys, 0.2, blocks);
  }();
  EXPECT_TRUE(tensors_close("blocked output", dnn.output, blas.output, kTolerance, kTolerance));
  EXPECT_TRUE(tensors_close("blocked lse", dnn.lse, blas.lse, kTolerance, kTolerance));
}

TEST(GemmTable, BlasCoreNamesMapToTheirVectorSets) {
  EXPECT_EQ(shardit::nn::cpu::blas_vector_level("Prescott"), 1);
  EXPECT_EQ(shardit::nn::cpu::blas_vector_level("Sandybridge"), 1);
  EXPECT_EQ(shardit::nn::cpu::blas_vector_level("Haswell"), 2);
  EXPECT_EQ(shardit::nn::cpu::blas_vector_level("ZEN"), 2);
  EXPECT_EQ(shardit::nn::cpu::blas_vector_level("SkylakeX"), 3);
  EXPECT_EQ(shardit::nn::cpu::blas_vector_level("SapphireRapids"), 3);
  EXPECT_EQ(shardit::nn::cpu::blas_vector_level(""), 0) << "no OpenBLAS: auto keeps BLAS";
  EXPECT_EQ(shardit::nn::cpu::blas_vector_level("FutureCore"), 0) << "an unknown core: auto keeps BLAS";
  const shardit::CpuFeatures& cpu = shardit::cpu_features();
  EXPECT_TRUE(!cpu.avx512f || cpu.vector_level() == 3);
  EXPECT_TRUE(!cpu.avx512_bf16 || cpu.avx512f) << cpu.to_string();
  EXPECT_FALSE(cpu.to_string().empty());
}

TEST_F(Gemm, AutoKeepsSmallProductsAndOtherDtypesOnBlasAndProbesOnce) {
  GemmBackendGuard guard(GemmBackend::Auto);
  // The probe (first run here: CTest starts a process per case) leaves the seeded generator alone,
  // so a pipeline's noise does not depend on when the first large product happens.
  at::manual_seed(9);
  const at::Tensor expected = at::randn({4});
  at::manual_seed(9);
  shardit::nn::gemm_probe();
  EXPECT_TRUE(at::equal(at::randn({4}), expected));
  EXPECT_EQ(shardit::nn::gemm_backend_for(at::kCPU, at::kFloat, 8, 1 << 24), GemmBackend::Blas);
  EXPECT_EQ(shardit::nn::gemm_backend_for(at::kCPU, at::kFloat, 4096, 16 * 16), GemmBackend::Blas);
  EXPECT_EQ(shardit::nn::gemm_backend_for(at::kCPU, at::kBFloat16, 4096, 1 << 24), GemmBackend::Blas);
  const shardit::nn::GemmProbe probe = shardit::nn::gemm_probe();
  EXPECT_GT(probe.blas_gflops, 0);
  EXPECT_GT(probe.onednn_gflops, 0);
  // Large products follow the machine's table, not the probe: oneDNN exactly when the BLAS
  // kernels' vector set is known and narrower than the CPU's.
  const int blas_level = shardit::nn::cpu::blas_vector_level(shardit::nn::cpu::blas_core_name());
  const GemmBackend expected_kernel = blas_level > 0 && blas_level < shardit::nn::cpu::cpu_vector_level()
                                          ? GemmBackend::OneDnn
                                          : GemmBackend::Blas;
  EXPECT_EQ(shardit::nn::auto_gemm_backend(), expected_kernel) << shardit::nn::gemm_kernel_summary();
  EXPECT_EQ(shardit::nn::gemm_backend_for(at::kCPU, at::kFloat, 4096, 1 << 24), expected_kernel);
  // Cached: the same answer without measuring again.
  EXPECT_EQ(shardit::nn::gemm_probe().blas_gflops, probe.blas_gflops);
  // A forced kernel applies at every size.
  GemmBackendGuard forced(GemmBackend::OneDnn);
  EXPECT_EQ(shardit::nn::gemm_backend_for(at::kCPU, at::kFloat, 1, 4), GemmBackend::OneDnn);
  EXPECT_EQ(shardit::nn::gemm_backend_for(at::kCPU, at::kBFloat16, 4096, 1 << 24), GemmBackend::Blas);
}

TEST(GemmSelection, UnknownKernelIsRejectedListingTheChoices) {
  const std::string message = error_of([] { shardit::nn::parse_gemm_backend("mkl"); });
  EXPECT_NE(message.find("unknown gemm backend 'mkl'; choose auto, blas, onednn or amx"), std::string::npos)
      << message;
  std::string output;
  const int status = shardit::testing::run_command(
      shardit::testing::cli_path() + " --gemm-backend mkl run-transformer --out /nonexistent/x.safetensors", &output);
  EXPECT_EQ(status, 1) << output;
  EXPECT_NE(output.find("unknown gemm backend 'mkl'"), std::string::npos) << output;
  // The same value from the environment fails before any work too.
  const int env_status = shardit::testing::run_command(
      "SHARDIT_GEMM_BACKEND=mkl " + shardit::testing::cli_path() + " run-transformer --out /nonexistent/x.safetensors",
      &output);
  EXPECT_EQ(env_status, 1) << output;
  EXPECT_NE(output.find("unknown gemm backend 'mkl'"), std::string::npos) << output;
}

// The AMX kernel (nn/cpu/amx_gemm.h). On a CPU without AMX-BF16 these check the other side of the
// contract: amx is refused with the reason, and auto leaves every bf16 Linear on at::linear.
//
// Bound: each output is an fp32 sum of bf16 products rounded once to bf16, so against the exact
// (float64) product of the same bf16 operands it is off by at most half a bf16 unit in the last
// place (2^-8 relative: 8 significant bits) plus the fp32 sum's own error (K 2^-24 of the sum of
// |x w|). Measured worst: 0.99 of that bound. A wrong pair order,
// block offset, tail row or bias moves outputs by O(1).
at::Tensor exact_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return at::linear(x.to(at::kDouble), w.to(at::kDouble), b.defined() ? b.to(at::kDouble) : at::Tensor());
}

::testing::AssertionResult within_one_rounding(const std::string& what, const at::Tensor& y, const at::Tensor& x,
                                               const at::Tensor& w, const at::Tensor& b) {
  const at::Tensor exact = exact_linear(x, w, b);
  const at::Tensor magnitude = at::linear(x.to(at::kDouble).abs(), w.to(at::kDouble).abs());
  const at::Tensor bound = exact.abs() * std::ldexp(1.0, -8) + magnitude * (w.size(1) * std::ldexp(1.0, -24)) + 1e-30;
  const at::Tensor excess = (y.to(at::kDouble) - exact).abs() / bound;
  const double worst = excess.max().item<double>();
  if (y.scalar_type() == at::kBFloat16 && y.sizes() == exact.sizes() && worst <= 1.0) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << what << ": " << y.sizes() << " " << y.scalar_type() << ", worst error "
                                       << worst << " of the bound";
}

TEST(AmxGemm, MatchesTheExactProductWithinOneRoundingOnOddShapes) {
  if (!shardit::nn::cpu::amx_gemm_available()) {
    const std::string reason = shardit::nn::cpu::amx_gemm_unavailable_reason();
    EXPECT_FALSE(reason.empty());
    EXPECT_NE(error_of([] { shardit::nn::parse_gemm_backend("amx"); }).find("gemm backend 'amx': " + reason),
              std::string::npos);
    EXPECT_FALSE(shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 4096, 3072, 3072));
    const at::Tensor x = at::randn({800, 256}).to(at::kBFloat16), w = at::randn({256, 256}).to(at::kBFloat16);
    EXPECT_TRUE(at::equal(shardit::nn::linear(x, w), at::linear(x, w)));
    return;
  }
  at::manual_seed(11);
  struct Case {
    int64_t rows, in, out;
    bool bias;
  };
  // Rows below, at and across a 32-row tile block and the 512-row block; depths across the
  // 512-deep block; widths across the 256-column block and the split between threads.
  const std::vector<Case> cases = {{1, 32, 32, true},      {31, 64, 96, false},    {33, 96, 32, true},
                                   {100, 544, 288, true},  {513, 1056, 544, true}, {1100, 64, 608, false},
                                   {64, 2048, 64, true}};
  for (const Case& c : cases) {
    const at::Tensor x = at::randn({c.rows, c.in}).to(at::kBFloat16);
    const at::Tensor w = (at::randn({c.out, c.in}) / std::sqrt(double(c.in))).to(at::kBFloat16);
    const at::Tensor b = c.bias ? at::randn({c.out}).to(at::kBFloat16) : at::Tensor();
    const std::string what = std::to_string(c.rows) + "x" + std::to_string(c.in) + "x" + std::to_string(c.out);
    const at::Tensor y = shardit::nn::cpu::amx_linear(x, w, b);
    EXPECT_TRUE(within_one_rounding(what, y, x, w, b));
    // The same bits through nn::linear under amx, and again (no state carried between calls).
    EXPECT_TRUE(at::equal(on(GemmBackend::Amx, [&] { return shardit::nn::linear(x, w, b); }), y)) << what;
  }
  // 3-D input, a strided input (a column slice) and a weight read in place from a wider one.
  const at::Tensor x3 = at::randn({2, 45, 128}).to(at::kBFloat16);
  const at::Tensor wide = at::randn({96, 192}).to(at::kBFloat16);
  const at::Tensor w_view = wide.narrow(1, 32, 128);
  const at::Tensor y3 = shardit::nn::cpu::amx_linear(x3, w_view, {});
  EXPECT_EQ(y3.sizes(), (std::vector<int64_t>{2, 45, 96}));
  EXPECT_TRUE(within_one_rounding("3-D, weight view", y3.reshape({90, 96}), x3.reshape({90, 128}), w_view, {}));
  const at::Tensor xs = at::randn({70, 300}).to(at::kBFloat16).narrow(1, 7, 256);
  const at::Tensor ws = at::randn({64, 256}).to(at::kBFloat16);
  EXPECT_TRUE(within_one_rounding("strided input", shardit::nn::cpu::amx_linear(xs, ws, {}), xs, ws, {}));
  // Column blocks read in place: the concatenation's bits, with a tail of rows and blocks deeper
  // and shallower than the kernel's 512-deep steps; a block width off the 32 grid is refused.
  const at::Tensor p0 = at::randn({77, 96}).to(at::kBFloat16), p1 = at::randn({77, 640}).to(at::kBFloat16);
  const at::Tensor wp = (at::randn({160, 736}) / 27).to(at::kBFloat16), bp = at::randn({160}).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(shardit::nn::cpu::amx_linear({p0, p1}, wp, bp),
                        shardit::nn::cpu::amx_linear(at::cat({p0, p1}, -1), wp, bp)));
  EXPECT_NE(error_of([&] {
              shardit::nn::cpu::amx_linear({p0.narrow(1, 0, 80), at::randn({77, 656}).to(at::kBFloat16)}, wp, bp);
            }).find("widths that are multiples of 32"),
            std::string::npos);
  // No rows: an empty result of the right shape.
  EXPECT_EQ(shardit::nn::cpu::amx_linear(at::randn({0, 64}).to(at::kBFloat16), at::randn({32, 64}).to(at::kBFloat16), {})
                .sizes(),
            (std::vector<int64_t>{0, 32}));
}

TEST(AmxGemm, SameBitsWithOneAndTwoThreadsAndNaNStaysInItsRow) {
  if (!shardit::nn::cpu::amx_gemm_available()) {
    EXPECT_THROW(shardit::nn::cpu::amx_linear(at::randn({32, 32}).to(at::kBFloat16),
                                              at::randn({32, 32}).to(at::kBFloat16), {}),
                 c10::Error);
    return;
  }
  at::manual_seed(12);
  const at::Tensor x = at::randn({600, 1024}).to(at::kBFloat16);
  const at::Tensor w = (at::randn({800, 1024}) / 32).to(at::kBFloat16);
  const at::Tensor b = at::randn({800}).to(at::kBFloat16);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor one = shardit::nn::cpu::amx_linear(x, w, b);
  at::set_num_threads(std::max(2, threads));
  const at::Tensor two = shardit::nn::cpu::amx_linear(x, w, b);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one, two));
  EXPECT_TRUE(at::equal(shardit::nn::cpu::amx_linear(x, w, b), two));
  // A NaN in row 5 of x makes row 5 of y NaN and leaves every other row finite.
  at::Tensor x_nan = x.clone();
  x_nan[5][17] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor y = shardit::nn::cpu::amx_linear(x_nan, w, b);
  EXPECT_TRUE(y[5].isnan().all().item<bool>());
  EXPECT_TRUE(at::equal(y.narrow(0, 6, 594), two.narrow(0, 6, 594)));
  EXPECT_TRUE(at::equal(y.narrow(0, 0, 5), two.narrow(0, 0, 5)));
}

// The GELU epilogue: gelu(x w^T + b, tanh) on each fp32 sum, rounded once. Against the float64
// GELU of the exact product: half a bf16 unit of the result, plus the fp32 sum's error bound
// (as above) times GELU's largest slope (1.13), plus the GELU's own approximation (relative
// 3e-6 of the input). Linear::forward_gelu_tanh takes it exactly where the product runs on the
// kernel; elsewhere it is forward, its pre-activation handed out, then the fused GELU.
TEST(AmxGemm, GeluEpilogueWithinOneRoundingAndLinearTakesItWhereTheKernelRuns) {
  at::manual_seed(14);
  const bool amx = shardit::nn::cpu::amx_gemm_available();
  shardit::nn::Linear layer(shardit::nn::LinearOptions(1056, 544));
  layer.weight = (at::randn({544, 1056}) / 16).to(at::kBFloat16);
  layer.bias = at::randn({544}).to(at::kBFloat16);
  const at::Tensor x = at::randn({2, 300, 1056}).to(at::kBFloat16);  // 600 rows: auto takes the kernel
  int handed_out = 0;
  const auto count = [&](const at::Tensor&) { ++handed_out; };
  const at::Tensor separate = [&] {
    at::Tensor y = layer.forward(x);
    return shardit::nn::gelu_tanh_(y);
  }();
  const at::Tensor fused = layer.forward_gelu_tanh(x, count);
  if (!amx) {
    EXPECT_TRUE(at::equal(fused, separate));
    EXPECT_EQ(handed_out, 1);
    EXPECT_THROW(shardit::nn::cpu::amx_linear_gelu_tanh(x, layer.weight, layer.bias), c10::Error);
    return;
  }
  EXPECT_EQ(handed_out, 0) << "the pre-activation does not exist on the kernel";
  EXPECT_TRUE(at::equal(fused, shardit::nn::cpu::amx_linear_gelu_tanh(x, layer.weight, layer.bias)));
  const at::Tensor x2 = x.reshape({600, 1056});
  const at::Tensor pre = exact_linear(x2, layer.weight, layer.bias);
  const at::Tensor exact = at::gelu(pre, "tanh");
  const at::Tensor magnitude = at::linear(x2.to(at::kDouble).abs(), layer.weight.to(at::kDouble).abs());
  const at::Tensor bound = exact.abs() * std::ldexp(1.0, -8) + magnitude * (1.13 * 1056 * std::ldexp(1.0, -24)) +
                           pre.abs() * 3e-6 + 1e-30;
  const double worst = ((fused.reshape({600, 544}).to(at::kDouble) - exact).abs() / bound).max().item<double>();
  EXPECT_LE(worst, 1.0) << "worst error of the bound";
  // One rounding instead of two: on average closer to the exact GELU than the separate pass.
  EXPECT_LT((fused.reshape({600, 544}).to(at::kDouble) - exact).abs().mean().item<double>(),
            (separate.reshape({600, 544}).to(at::kDouble) - exact).abs().mean().item<double>());
  // Rows that stay on at::linear (512 and fewer under auto), and every row under onednn: forward,
  // the pre-activation handed out, the fused GELU.
  const at::Tensor few = x.narrow(1, 0, 200);
  at::Tensor few_separate = layer.forward(few);
  shardit::nn::gelu_tanh_(few_separate);
  EXPECT_TRUE(at::equal(layer.forward_gelu_tanh(few, count), few_separate));
  EXPECT_EQ(handed_out, 1);
  {
    GemmBackendGuard onednn(GemmBackend::OneDnn);
    at::Tensor on_linear = layer.forward(x);
    shardit::nn::gelu_tanh_(on_linear);
    EXPECT_TRUE(at::equal(layer.forward_gelu_tanh(x, count), on_linear));
    EXPECT_EQ(handed_out, 2);
  }
}

TEST(AmxGemm, AutoTakesLargeBf16LinearsOnlyAndRefusesWhatItCannotTake) {
  const bool amx = shardit::nn::cpu::amx_gemm_available();
  GemmBackendGuard guard(GemmBackend::Auto);
  EXPECT_EQ(shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 513, 256, 256), amx);
  EXPECT_FALSE(shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 512, 3072, 3072));
  EXPECT_FALSE(shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 4096, 224, 3072));
  EXPECT_FALSE(shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 4096, 3072, 64));
  EXPECT_FALSE(shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 4096, 3072 + 16, 3072));
  EXPECT_FALSE(shardit::nn::linear_on_amx(at::kCPU, at::kFloat, 4096, 3072, 3072));
  EXPECT_NE(shardit::nn::gemm_kernel_summary().find(amx ? "bf16 Linears on amx" : "bf16 Linears on at::linear"),
            std::string::npos)
      << shardit::nn::gemm_kernel_summary();
  for (GemmBackend other : {GemmBackend::Blas, GemmBackend::OneDnn}) {
    if (other == GemmBackend::OneDnn && !at::hasMKLDNN()) continue;
    GemmBackendGuard g(other);
    EXPECT_FALSE(shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 4096, 3072, 3072)) << shardit::nn::gemm_backend_name(other);
  }
  if (!amx) return;
  GemmBackendGuard forced(GemmBackend::Amx);
  EXPECT_TRUE(shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 1, 32, 32));
  EXPECT_FALSE(shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 1, 48, 32));
  // A width the kernel does not take is at::linear's under amx; a direct call says why.
  const at::Tensor x = at::randn({40, 48}).to(at::kBFloat16), w = at::randn({32, 48}).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(shardit::nn::linear(x, w), at::linear(x, w)));
  EXPECT_NE(error_of([&] { shardit::nn::cpu::amx_linear(x, w, {}); }).find("in and out must be multiples of 32"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              shardit::nn::cpu::amx_linear(at::randn({40, 64}), at::randn({32, 64}).to(at::kBFloat16), {});
            }).find("expected bf16"),
            std::string::npos);
  // The Linear layer's block path gives the concatenated input's bits on the kernel.
  shardit::nn::Linear layer(shardit::nn::LinearOptions(96, 64).with_in_blocks({32, 64}));
  layer.weight = (at::randn({64, 96}) / 10).to(at::kBFloat16);
  layer.bias = at::randn({64}).to(at::kBFloat16);
  const at::Tensor a = at::randn({2, 50, 32}).to(at::kBFloat16), c = at::randn({2, 50, 64}).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(layer.forward_blocks({a, c}), layer.forward(at::cat({a, c}, -1))));
  EXPECT_TRUE(at::equal(layer.forward(at::cat({a, c}, -1)),
                        shardit::nn::cpu::amx_linear(at::cat({a, c}, -1), layer.weight, layer.bias)));
}

// The golden transformer cases with every product on oneDNN: the sample must match diffusers'.
class GemmGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(GemmGolden, OneDnnProductsMatchTheGoldenSample) {
  if (!at::hasMKLDNN()) GTEST_SKIP() << "the linked LibTorch has no oneDNN";
  const std::string dir = shardit::testing::golden_path(GetParam());
  const auto model = shardit::testing::load_transformer(dir);
  const at::Tensor golden = shardit::io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample");
  for (const std::string attention : {"math", "memory_efficient"}) {
    shardit::nn::AttentionBackendGuard attention_guard(attention);
    const at::Tensor blas = on(GemmBackend::Blas, [&] { return shardit::testing::run_case(*model, dir); });
    const at::Tensor dnn = on(GemmBackend::OneDnn, [&] { return shardit::testing::run_case(*model, dir); });
    EXPECT_TRUE(tensors_close(GetParam() + " (" + attention + "): onednn vs golden", dnn, golden, kGoldenTolerance,
                              kGoldenTolerance));
    EXPECT_TRUE(tensors_close(GetParam() + " (" + attention + "): onednn vs blas", dnn, blas, kGoldenTolerance,
                              kGoldenTolerance));
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, GemmGolden,
                         ::testing::Values("flux_b2_nonsquare", "flux2_b2_nonsquare", "flux2_klein_b2_nonsquare",
                                           "qwenimage_b2_nonsquare"));

TEST(KernelScratch, KeepsItsSizeButNotAnOutsizedOne) {
  shardit::nn::cpu::GrowingBuffer buffer;
  void* first = buffer.get(1 << 20, "test scratch");
  EXPECT_EQ(buffer.get(4096, "test scratch"), first) << "a smaller request reuses the block";
  EXPECT_EQ(buffer.capacity(), size_t{1} << 20);
  const size_t outsized = shardit::nn::cpu::GrowingBuffer::kMaxKeptBytes + (size_t{1} << 20);
  EXPECT_NE(buffer.get(outsized, "test scratch"), nullptr);
  EXPECT_EQ(buffer.capacity(), outsized);
  // The next request within the bound gives the outsized block back.
  EXPECT_NE(buffer.get(2 << 20, "test scratch"), nullptr);
  EXPECT_EQ(buffer.capacity(), size_t{2} << 20);
  EXPECT_NE(buffer.get(0, "test scratch"), nullptr);
}

}  // namespace
}  // namespace test_gemm
