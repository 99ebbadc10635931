// The fused CPU kernels (nn/cpu/fused.h) against the operations they replace: GELU(tanh), RMSNorm
// and LayerNorm + modulation in bf16 within one bf16 rounding of a float64 reference; the rotary
// embedding bit for bit equal to its fp32 formula; the attention softmax against float64, with
// masks, fully masked rows and row lengths that are not a multiple of the vector width. Each is
// also checked to give the same bits with 1 and 2 threads, and for what it refuses.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "shardit/nn/attention/memory_efficient.h"
#include "shardit/nn/cpu/fused.h"
#include "shardit/nn/norms.h"

namespace test_fused_kernels {
namespace {

namespace cpu = shardit::nn::cpu;

/// Runs f with `threads` intra-op threads, then restores the count.
template <class F>
auto with_threads(int threads, F f) {
  const int before = at::get_num_threads();
  at::set_num_threads(threads);
  auto result = f();
  at::set_num_threads(before);
  return result;
}

/// Runs `body` once on every fused-kernel build this CPU can run (AVX-512 with and without
/// AVX512-BF16, AVX2, portable), so each build is checked here whatever the CI machine would pick.
template <class F>
void for_each_build(F body) {
  for (const std::string& build : cpu::fused_kernel_builds()) {
    if (build == "off") continue;
    const cpu::FusedKernelsScope scope(build);
    SCOPED_TRACE("fused kernels: " + build);
    body(build);
  }
}

/// Largest |a - b| in units of b's bf16 spacing (2^-7 relative), where an absolute error below
/// 1e-6 counts as none (values that small round alike or flush, and do not matter after a product).
double bf16_ulps(const at::Tensor& a, const at::Tensor& reference) {
  const at::Tensor ref = reference.to(at::kDouble);
  const at::Tensor error = at::clamp_min((a.to(at::kDouble) - ref).abs() - 1e-6, 0.0);
  return (error / (ref.abs() * std::ldexp(1.0, -7) + 1e-30)).max().item<double>();
}

TEST(FusedKernels, ReportTheBuildTheCpuRunsAndRefuseOnesItCannot) {
  const std::string name = cpu::fused_kernels_name();
  EXPECT_TRUE(name == "avx512_bf16" || name == "avx512" || name == "avx2" || name == "default" || name == "off")
      << name;
  const std::vector<std::string> builds = cpu::fused_kernel_builds();
  ASSERT_GE(builds.size(), 2u);
  EXPECT_EQ(builds[builds.size() - 2], "default") << "the portable build is always there";
  EXPECT_EQ(builds.back(), "off");
  {
    const cpu::FusedKernelsScope scope("default");
    EXPECT_STREQ(cpu::fused_kernels_name(), "default");
  }
  EXPECT_EQ(cpu::fused_kernels_name(), name);
  try {
    const cpu::FusedKernelsScope scope("avx9");
    ADD_FAILURE() << "an unknown build was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("which this CPU cannot run"), std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(FusedKernels, GeluTanhInBf16IsWithinOneRoundingOfFloat64AndKeepsNan) {
  if (!cpu::fused_kernels_enabled()) GTEST_SKIP() << "the fused kernels are off";
  for_each_build([&](const std::string&) {
    at::manual_seed(0);
    // Odd length: a tail shorter than a vector; values over the range GELU is used on.
    at::Tensor x = (at::randn({3, 1001}) * 4).to(at::kBFloat16);
    x.index_put_({0, 0}, 0.0);
    x.index_put_({0, 1}, 30.0);
    x.index_put_({0, 2}, -30.0);
    // Far out, where e^(-2y) leaves the float range: the exponent is clamped, the result stays
    // finite.
    x.index_put_({0, 3}, 300.0);
    x.index_put_({0, 4}, -300.0);
    const at::Tensor x64 = x.to(at::kDouble);
    const at::Tensor reference =
        0.5 * x64 * (1 + at::tanh(std::sqrt(2.0 / M_PI) * (x64 + 0.044715 * x64 * x64 * x64)));
    at::Tensor y = x.clone();
    ASSERT_TRUE(cpu::try_gelu_tanh_(y));
    EXPECT_LE(bf16_ulps(y, reference), 1.0);
    EXPECT_EQ(y[0][0].item<float>(), 0.0f);
    EXPECT_EQ(y[0][1].item<float>(), 30.0f);
    EXPECT_NEAR(y[0][2].item<float>(), 0.0f, 1e-30f);
    EXPECT_EQ(y[0][3].item<float>(), 300.0f);
    EXPECT_NEAR(y[0][4].item<float>(), 0.0f, 1e-30f);
    // LibTorch's own bf16 GELU agrees to one rounding too.
    EXPECT_LE(bf16_ulps(y, at::gelu(x.to(at::kFloat), "tanh")), 1.0);
    at::Tensor nan = at::full({20}, std::numeric_limits<float>::quiet_NaN(), at::kBFloat16);
    ASSERT_TRUE(cpu::try_gelu_tanh_(nan));
    EXPECT_TRUE(nan.isnan().all().item<bool>());
    // Same bits with 1 and 2 threads (a large tensor, so that 2 threads do split it).
    const at::Tensor big = at::randn({300, 1024}).to(at::kBFloat16);
    const auto run = [&](int threads) {
      return with_threads(threads, [&] {
        at::Tensor out = big.clone();
        cpu::try_gelu_tanh_(out);
        return out;
      });
    };
    EXPECT_TRUE(at::equal(run(1), run(2)));
  });
}

TEST(FusedKernels, GeluTanhLeavesFp32AndStridedInputsToLibTorch) {
  at::Tensor fp32 = at::randn({8, 8});
  EXPECT_FALSE(cpu::try_gelu_tanh_(fp32));
  at::Tensor strided = at::randn({8, 8}).to(at::kBFloat16).t();
  EXPECT_FALSE(cpu::try_gelu_tanh_(strided));
}

TEST(FusedKernels, RmsNormInBf16MatchesTheReferenceRoundings) {
  if (!cpu::fused_kernels_enabled()) GTEST_SKIP() << "the fused kernels are off";
  for_each_build([&](const std::string&) {
    at::manual_seed(1);
    // [B, S, H, D] with D = 72 (not a multiple of 16) as a strided view of a wider projection.
    const at::Tensor wide = at::randn({2, 5, 3 * 72 + 8}).to(at::kBFloat16);
    const at::Tensor x = wide.narrow(2, 4, 3 * 72).unflatten(2, {3, 72});
    for (const at::ScalarType weight_type : {at::kBFloat16, at::kFloat}) {
      const at::Tensor weight = (at::rand({72}) + 0.5).to(weight_type);
      at::Tensor out;
      ASSERT_TRUE(cpu::try_rms_norm(x, weight, 1e-6, out));
      // diffusers: y = x * rsqrt(mean(x^2) + eps) in fp32; cast to a bf16 weight's dtype, then times it.
      const at::Tensor x32 = x.to(at::kFloat);
      const at::Tensor y = x32 * at::rsqrt(x32.pow(2).mean(-1, true) + 1e-6);
      const at::Tensor reference = weight_type == at::kBFloat16
                                       ? y.to(at::kBFloat16).to(at::kFloat) * weight.to(at::kFloat)
                                       : y * weight;
      EXPECT_LE(bf16_ulps(out, reference), 1.0) << weight_type;
      EXPECT_TRUE(out.is_contiguous());
    }
    at::Tensor out;
    EXPECT_FALSE(cpu::try_rms_norm(at::randn({4, 8}), {}, 1e-6, out)) << "fp32 stays on LibTorch";
  });
}

TEST(FusedKernels, LayerNormModulateMatchesModulateOfLayerNorm) {
  if (!cpu::fused_kernels_enabled()) GTEST_SKIP() << "the fused kernels are off";
  for_each_build([&](const std::string&) {
    at::manual_seed(2);
    const int64_t batch = 3, seq = 7, dim = 100;
    const at::Tensor x = (at::randn({batch, seq, dim}) * 3 + 1).to(at::kBFloat16);
    // shift and scale as chunks of one [B, 6D] modulation: strided rows
    const at::Tensor emb = at::randn({batch, 6 * dim}).to(at::kBFloat16);
    const at::Tensor shift = emb.narrow(1, 0, dim), scale = emb.narrow(1, dim, dim);
    at::Tensor fused;
    ASSERT_TRUE(cpu::try_layer_norm_modulate(x, 1e-6, shift, scale, fused));
    const at::Tensor unfused = shardit::nn::modulate(shardit::nn::layer_norm(x, 1e-6), shift, scale);
    // The three bf16 roundings are the same; only the fp32 statistics may differ in their last bit.
    EXPECT_LE(bf16_ulps(fused, unfused), 1.0);
    EXPECT_GT(at::eq(fused, unfused).to(at::kFloat).mean().item<double>(), 0.99);
    EXPECT_TRUE(at::equal(shardit::nn::modulated_layer_norm(x, 1e-6, shift, scale), fused));
    // [B, 1, D] modulation is not [B, D]: refused, and the unfused path serves it.
    at::Tensor out;
    EXPECT_FALSE(cpu::try_layer_norm_modulate(x, 1e-6, shift.unsqueeze(1), scale, out));
  });
}

TEST(FusedKernels, InterleavedRopeEqualsItsFp32FormulaBitForBit) {
  for_each_build([&](const std::string&) {
    at::manual_seed(3);
    const int64_t batch = 2, seq = 9, heads = 3, dim = 40;
    const at::Tensor cos = at::rand({seq, dim}) * 2 - 1, sin = at::rand({seq, dim}) * 2 - 1;
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor x = at::randn({batch, seq, heads, dim}).to(dtype);
      // out: rows of a wider joint buffer, as joint attention writes them
      at::Tensor joint = at::zeros({batch, seq + 4, heads, dim}, x.options());
      at::Tensor out = joint.narrow(1, 4, seq);
      if (!cpu::try_rope_interleaved(x, cos, sin, out)) {
        ASSERT_FALSE(cpu::fused_kernels_enabled());
        continue;
      }
      const at::Tensor pairs = x.to(at::kFloat).unflatten(-1, {dim / 2, 2});
      const at::Tensor even = pairs.select(-1, 0), odd = pairs.select(-1, 1);
      const at::Tensor c = cos.slice(1, 0, dim, 2).unsqueeze(1), s = sin.slice(1, 0, dim, 2).unsqueeze(1);
      const at::Tensor c_odd = cos.slice(1, 1, dim, 2).unsqueeze(1), s_odd = sin.slice(1, 1, dim, 2).unsqueeze(1);
      const at::Tensor reference =
          at::stack({even * c - odd * s, odd * c_odd + even * s_odd}, -1).flatten(-2).to(dtype);
      EXPECT_TRUE(at::equal(out, reference)) << dtype;
      EXPECT_EQ(joint.narrow(1, 0, 4).abs().sum().item<double>(), 0.0) << "rows outside out untouched";
    }
  });
}

TEST(FusedKernels, SoftmaxRowsMatchFloat64WithMasksAndOddLengths) {
  if (!cpu::fused_kernels_enabled()) GTEST_SKIP() << "the fused kernels are off";
  for_each_build([&](const std::string&) {
    at::manual_seed(4);
    const double scale = 0.125;
    for (const int64_t keys : {1, 15, 16, 37, 300}) {
      for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        const at::Tensor scores = (at::randn({6, keys}) * 20).to(dtype);
        at::Tensor mask = at::rand({6, keys}) > 0.3;
        mask[1].fill_(false);  // a row with every key masked
        mask[2].fill_(true);
        for (const bool masked : {false, true}) {
          at::Tensor probs, row_max, row_sum;
          ASSERT_TRUE(cpu::try_softmax_rows(scores, masked ? mask : at::Tensor(), scale, /*normalize=*/true, probs,
                                            row_max, row_sum));
          ASSERT_EQ(probs.scalar_type(), dtype);
          at::Tensor logits = scores.to(at::kDouble) * scale;
          if (masked) logits = logits.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
          for (int64_t r = 0; r < 6; ++r) {
            if (masked && !mask[r].any().item<bool>()) {
              EXPECT_EQ(probs[r].abs().sum().item<double>(), 0.0) << "fully masked row: weights 0, not NaN";
              EXPECT_TRUE(std::isinf(row_max[r].item<float>()) && row_max[r].item<float>() < 0);
              EXPECT_EQ(row_sum[r].item<float>(), 0.0f);
              continue;
            }
            const at::Tensor reference = at::softmax(logits[r], 0);
            const double tolerance = dtype == at::kFloat ? 2e-6 : std::ldexp(1.0, -8);
            EXPECT_LE((probs[r].to(at::kDouble) - reference).abs().max().item<double>(), tolerance)
                << "keys " << keys << " " << dtype << (masked ? " masked" : "");
            // lse = row_max + log(row_sum) is the log-sum-exp of the scaled, masked scores.
            const double lse = row_max[r].item<float>() + std::log(row_sum[r].item<float>());
            EXPECT_NEAR(lse, at::logsumexp(logits[r], 0).item<double>(), 1e-5);
          }
        }
      }
    }
  });
}

TEST(FusedKernels, SoftmaxRowsAreTheSameBitsWithOneOrTwoThreads) {
  if (!cpu::fused_kernels_enabled()) GTEST_SKIP() << "the fused kernels are off";
  for_each_build([&](const std::string&) {
    const at::Tensor scores = at::randn({512, 1000}).to(at::kBFloat16);
    const auto run = [&](int threads) {
      return with_threads(threads, [&] {
        at::Tensor probs, row_max, row_sum;
        cpu::try_softmax_rows(scores, {}, 0.1, true, probs, row_max, row_sum);
        return at::cat({probs.to(at::kFloat).flatten(), row_max, row_sum});
      });
    };
    EXPECT_TRUE(at::equal(run(1), run(2)));
  });
}

TEST(FusedKernels, AttentionIsTheSameBitsWithOneOrTwoThreads) {
  for_each_build([&](const std::string&) {
    // Each (batch, head, query block) is one task with single-threaded products: the thread count
    // may not change a bit. (The query block is set by the shapes alone; a product's bits may
    // depend on its row count, as BLAS's fp32 kernels do.)
    at::manual_seed(5);
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor q = at::randn({2, 3, 200, 32}).to(dtype), k = at::randn({2, 3, 150, 32}).to(dtype);
      const at::Tensor v = at::randn({2, 3, 150, 32}).to(dtype);
      at::Tensor keys = at::rand({2, 1, 1, 150}) > 0.2;
      keys.select(-1, 0).fill_(true);
      for (const bool masked : {false, true}) {
        const std::optional<at::Tensor> mask = masked ? std::optional<at::Tensor>(keys) : std::nullopt;
        const auto run = [&](int threads, int64_t query_block) {
          return with_threads(threads, [&] {
            shardit::nn::MemoryEfficientOptions options;
            options.query_block = query_block;
            const shardit::nn::AttentionWithLse out =
                shardit::nn::memory_efficient_attention(q, k, v, mask, 0.17, options);
            return at::cat({out.output.to(at::kFloat).flatten(), out.lse.flatten()});
          });
        };
        EXPECT_TRUE(at::equal(run(2, 0), run(1, 0))) << dtype << " masked " << masked;
        EXPECT_TRUE(at::equal(run(2, 48), run(1, 48))) << dtype << " masked " << masked << ", query blocks of 48";
      }
    }
  });
}

TEST(FusedKernels, SoftmaxRowsRefuseWhatTheyDoNotRead) {
  at::Tensor probs, row_max, row_sum;
  const at::Tensor scores = at::randn({4, 8});
  EXPECT_FALSE(cpu::try_softmax_rows(scores.t(), {}, 1.0, true, probs, row_max, row_sum)) << "strided";
  EXPECT_FALSE(cpu::try_softmax_rows(scores.to(at::kDouble), {}, 1.0, true, probs, row_max, row_sum)) << "double";
  EXPECT_FALSE(cpu::try_softmax_rows(scores, at::zeros({4, 8}), 1.0, true, probs, row_max, row_sum))
      << "an additive mask";
  EXPECT_FALSE(cpu::try_softmax_rows(scores, at::ones({4, 1}, at::kBool), 1.0, true, probs, row_max, row_sum))
      << "a mask broadcast over the keys";
  // The kernel subtracts the row's maximum, which is the largest weight only for a positive scale.
  for (const double scale : {0.0, -0.5, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    EXPECT_FALSE(cpu::try_softmax_rows(scores, {}, scale, true, probs, row_max, row_sum)) << "scale " << scale;
  }
}

TEST(FusedKernels, AttentionWithANegativeScaleRunsTheOperators) {
  at::manual_seed(3);
  const at::Tensor q = at::randn({1, 2, 5, 8}), k = at::randn({1, 2, 7, 8}), v = at::randn({1, 2, 7, 8});
  const double scale = -0.5;
  const at::Tensor expected = at::matmul(at::softmax(at::matmul(q, k.transpose(-1, -2)) * scale, -1), v);
  const at::Tensor out = shardit::nn::memory_efficient_attention(q, k, v, std::nullopt, scale).output;
  EXPECT_TRUE(at::allclose(out, expected, 1e-5, 1e-6)) << (out - expected).abs().max().item<float>();
}

}  // namespace
}  // namespace test_fused_kernels
