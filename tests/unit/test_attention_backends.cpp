// Every available attention backend against the `math` reference: random shapes (uneven blocks,
// cross attention, batch > 1) with boolean and additive masks broadcast in every way the models
// use, fp32 and bf16; the memory-efficient backend's log-sum-exp; selection, refusal and dispatch
// counting; and the three transformers' golden cases run on each backend.
//
// Tolerances: a backend differs from math only in the order of fp32 sums (blocked softmax sums,
// rescaled partial outputs): ~1e-7 relative, so 1e-5 absolute + relative on O(1) outputs. In bf16
// both round scores and probabilities to bf16 at different points: 2e-2 (bf16 rounding 4e-3, a
// few roundings deep). The golden cases use the golden tolerance of the fp32 transformers
// (1e-4 absolute + relative, the golden README's).
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "shardit/core/compat.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/nn/attention/bf16_kernels.h"
#include "shardit/nn/attention/memory_efficient.h"
#include "shardit/nn/cpu/bf16_attention.h"
#include "shardit/nn/cpu/amx_gemm.h"
#include "shardit/nn/gemm.h"
#include "shardit/verify/transformer_case.h"
#include "support/test_support.h"

namespace test_attention_backends {
namespace {

using shardit::nn::AttentionBackendGuard;
using shardit::testing::error_of;
using shardit::testing::tensors_close;

constexpr double kFp32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 2e-2;
constexpr double kBf16ExactTolerance = 4e-2;  // absolute, bf16 output against float64 (see below)
constexpr double kGoldenTolerance = 1e-4;

struct Shape {
  int64_t batch, heads, s_q, s_kv, head_dim;
};

at::Tensor run_with(const std::string& backend, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& mask) {
  AttentionBackendGuard guard(backend);
  return shardit::nn::scaled_dot_product_attention(q, k, v, mask);
}

/// The masks the models and callers pass, for a given shape (std::nullopt first).
std::vector<std::pair<std::string, std::optional<at::Tensor>>> masks_for(const Shape& s) {
  std::vector<std::pair<std::string, std::optional<at::Tensor>>> masks;
  masks.emplace_back("none", std::nullopt);
  // Key padding per sample (Qwen-Image's text mask): [B, 1, 1, S_kv], at least one key kept.
  at::Tensor keys = at::rand({s.batch, 1, 1, s.s_kv}) > 0.3;
  keys.select(-1, 0).fill_(true);
  masks.emplace_back("bool keys [B,1,1,S_kv]", keys);
  // A boolean mask per query and key with no fully masked row: [B, H, S_q, S_kv].
  at::Tensor full = at::rand({s.batch, s.heads, s.s_q, s.s_kv}) > 0.5;
  full.select(-1, s.s_kv - 1).fill_(true);
  masks.emplace_back("bool [B,H,S_q,S_kv]", full);
  // Additive biases: per head without a batch dimension, and per query broadcast over batch.
  masks.emplace_back("additive [H,1,S_kv]", at::randn({s.heads, 1, s.s_kv}));
  masks.emplace_back("additive [S_q,S_kv]", at::randn({s.s_q, s.s_kv}) * 3);
  return masks;
}

using shardit::nn::cpu::Bf16AttentionKernel;
constexpr Bf16AttentionKernel kBf16Kernels[] = {Bf16AttentionKernel::amx, Bf16AttentionKernel::avx512_bf16};

/// The bf16 kernel behind a backend name ("amx", "avx512_bf16"), none for the other backends.
std::optional<Bf16AttentionKernel> own_kernel(const std::string& backend) {
  for (const Bf16AttentionKernel kernel : kBf16Kernels) {
    if (backend == shardit::nn::cpu::bf16_attention_kernel_name(kernel)) return kernel;
  }
  return std::nullopt;
}

bool kernel_available(Bf16AttentionKernel kernel) {
  return shardit::nn::cpu::bf16_attention_kernel_unavailable_reason(kernel).empty();
}

/// The bf16 kernel "auto" takes on this CPU: amx, else avx512_bf16, where available.
std::optional<Bf16AttentionKernel> auto_kernel() {
  for (const Bf16AttentionKernel kernel : kBf16Kernels) {
    if (kernel_available(kernel)) return kernel;
  }
  return std::nullopt;
}

class AttentionBackendsRandom : public ::testing::TestWithParam<std::string> {};

TEST_P(AttentionBackendsRandom, MatchMathOnRandomShapesWithMasks) {
  const std::string backend = GetParam();
  at::manual_seed(11);
  int refusals = 0, bf16_runs = 0;
  for (const Shape& s : {Shape{1, 3, 37, 37, 16}, Shape{2, 4, 130, 70, 8}, Shape{2, 2, 600, 1100, 32},
                         Shape{1, 5, 1, 513, 64}}) {
    const at::Tensor q = at::randn({s.batch, s.heads, s.s_q, s.head_dim});
    const at::Tensor k = at::randn({s.batch, s.heads, s.s_kv, s.head_dim}) * 2;
    const at::Tensor v = at::randn({s.batch, s.heads, s.s_kv, s.head_dim});
    for (const auto& [name, mask] : masks_for(s)) {
      const std::string what = backend + " vs math, q " + std::to_string(s.s_q) + " x kv " +
                               std::to_string(s.s_kv) + ", mask " + name;
      const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
      // A call the backend refuses (amx, avx512_bf16: f32, head sizes they do not take, additive
      // masks, a CPU without their instructions) must fail with the reason, not run elsewhere.
      const auto refused = [&](const at::Tensor& qq, const at::Tensor& kk, const at::Tensor& vv) {
        const std::string why = shardit::nn::attention_backend_refusal(
            shardit::nn::attention_backend(backend), shardit::nn::AttentionCall{qq, kk, vv, mask, scale});
        if (why.empty()) return false;
        const std::string message = error_of([&] { run_with(backend, qq, kk, vv, mask); });
        EXPECT_NE(message.find(why), std::string::npos) << what << ": " << message;
        ++refusals;
        return true;
      };
      if (!refused(q, k, v)) {
        const at::Tensor expected = run_with("math", q, k, v, mask);
        EXPECT_TRUE(tensors_close(what, run_with(backend, q, k, v, mask), expected, kFp32Tolerance, kFp32Tolerance));
      }
      const at::Tensor qb = q.to(at::kBFloat16), kb = k.to(at::kBFloat16), vb = v.to(at::kBFloat16);
      if (refused(qb, kb, vb)) continue;
      ++bf16_runs;
      const at::Tensor out_bf16 = run_with(backend, qb, kb, vb, mask);
      EXPECT_EQ(out_bf16.scalar_type(), at::kBFloat16);
      // Against the exact attention of the bf16 inputs (float64), not another bf16 result: two
      // bf16 results can each be within the tolerance of it and further apart. Scores of
      // magnitude ~40 round to bf16 with errors of 0.1, which some outputs amplify to ~0.03;
      // on average the backend must be as accurate as the math backend.
      const at::Tensor exact = run_with("math", qb.to(at::kDouble), kb.to(at::kDouble), vb.to(at::kDouble), mask);
      EXPECT_TRUE(tensors_close(what + " (bf16)", out_bf16.to(at::kFloat), exact.to(at::kFloat), kBf16ExactTolerance,
                                kBf16Tolerance));
      const double mean_error = (out_bf16.to(at::kDouble) - exact).abs().mean().item<double>();
      const double math_mean_error =
          (run_with("math", qb, kb, vb, mask).to(at::kDouble) - exact).abs().mean().item<double>();
      EXPECT_LE(mean_error, 1.25 * math_mean_error + 1e-6) << what << " (bf16): mean error against float64";
    }
  }
  // Only the bf16 kernels refuse calls here; where one runs (a CPU with its instructions) it must
  // take the bf16 calls with head sizes of 32 and 64 and the bool masks.
  const auto kernel = own_kernel(backend);
  if (!kernel) {
    EXPECT_EQ(refusals, 0) << backend;
  } else if (shardit::nn::cpu::bf16_attention_kernel_unavailable_reason(*kernel).empty()) {
    EXPECT_EQ(bf16_runs, 6) << backend;
  }
}

std::vector<std::string> available_backends() { return shardit::nn::attention_backend_names(); }

INSTANTIATE_TEST_SUITE_P(Available, AttentionBackendsRandom, ::testing::ValuesIn(available_backends()));

TEST(MemoryEfficientAttention, SmallBlocksMatchMathAndReturnTheLogSumExp) {
  at::manual_seed(12);
  const at::Tensor q = at::randn({2, 3, 45, 16}), k = at::randn({2, 3, 77, 16}), v = at::randn({2, 3, 77, 16});
  at::Tensor keep = at::rand({2, 1, 45, 77}) > 0.4;
  keep.select(-1, 3).fill_(true);
  const double scale = 0.3;
  shardit::nn::MemoryEfficientOptions options;
  options.query_block = 7;
  options.key_block = 10;
  const auto result = shardit::nn::memory_efficient_attention(q, k, v, keep, scale, options);
  EXPECT_TRUE(tensors_close("blocked output", result.output, shardit::nn::math_attention(q, k, v, keep, scale),
                            kFp32Tolerance, kFp32Tolerance));
  const at::Tensor scores = (at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-2, -1)) * scale)
                                .masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(tensors_close("lse", result.lse, at::logsumexp(scores, -1).to(at::kFloat), 1e-5, 1e-5));
}

TEST(MemoryEfficientAttention, PartialResultsOverKeyShardsMergeByTheirLogSumExp) {
  // What ring attention does: attention over two halves of the keys, merged by lse.
  at::manual_seed(13);
  const at::Tensor q = at::randn({1, 2, 33, 8}), k = at::randn({1, 2, 64, 8}), v = at::randn({1, 2, 64, 8});
  const double scale = 1.0 / std::sqrt(8.0);
  const auto a = shardit::nn::memory_efficient_attention(q, k.narrow(2, 0, 40), v.narrow(2, 0, 40), {}, scale);
  const auto b = shardit::nn::memory_efficient_attention(q, k.narrow(2, 40, 24), v.narrow(2, 40, 24), {}, scale);
  const at::Tensor lse = at::logaddexp(a.lse, b.lse);
  const at::Tensor merged =
      a.output * (a.lse - lse).exp().unsqueeze(-1) + b.output * (b.lse - lse).exp().unsqueeze(-1);
  EXPECT_TRUE(tensors_close("merged", merged, shardit::nn::math_attention(q, k, v, {}, scale), kFp32Tolerance,
                            kFp32Tolerance));
}

TEST(MemoryEfficientAttention, FullyMaskedQueryGivesZeroAndMinusInfinity) {
  at::manual_seed(14);
  const at::Tensor q = at::randn({1, 1, 4, 8}), k = at::randn({1, 1, 20, 8}), v = at::randn({1, 1, 20, 8});
  at::Tensor keep = at::ones({1, 1, 4, 20}, at::kBool);
  keep[0][0][2].fill_(false);
  shardit::nn::MemoryEfficientOptions options;
  options.key_block = 6;
  const auto result = shardit::nn::memory_efficient_attention(q, k, v, keep, 0.5, options);
  EXPECT_TRUE(at::isfinite(result.output).all().item<bool>());
  EXPECT_EQ(result.output[0][0][2].abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(std::isinf(result.lse[0][0][2].item<float>()));
  EXPECT_TRUE(at::isfinite(result.lse[0][0][1]).item<bool>());
}

TEST(AttentionBackends, AutoTakesTheDevicesFirstBackendAndCountsDispatches) {
  at::manual_seed(15);
  const at::Tensor q = at::randn({1, 2, 5, 8});
  ASSERT_EQ(shardit::nn::default_attention_backends(c10::DeviceType::CPU),
            (std::vector<std::string>{"amx", "avx512_bf16", "memory_efficient", "math"}));
  shardit::nn::reset_attention_dispatch_counts();
  {
    AttentionBackendGuard guard("auto");
    shardit::nn::scaled_dot_product_attention(q, q, q);
    shardit::nn::scaled_dot_product_attention(q, q, q);
  }
  auto counts = shardit::nn::attention_dispatch_counts();
  EXPECT_EQ(counts["memory_efficient"], 2);
  EXPECT_EQ(counts.count("math"), 0u);
  run_with("math", q, q, q, std::nullopt);
  counts = shardit::nn::attention_dispatch_counts();
  EXPECT_EQ(counts["math"], 1);
  EXPECT_EQ(counts["memory_efficient"], 2);
}

TEST(AttentionBackends, UnknownBackendIsRejectedListingTheAvailableOnes) {
  const std::string message = error_of([] { shardit::nn::set_attention_backend("flash9"); });
  EXPECT_NE(message.find("attention backend 'flash9' is not available"), std::string::npos) << message;
  EXPECT_NE(message.find("math"), std::string::npos) << message;
  EXPECT_NE(message.find("memory_efficient"), std::string::npos) << message;
  EXPECT_EQ(shardit::nn::attention_backend_selection(), "auto");
}

TEST(AttentionBackends, BackendThatCannotHonourACallRefusesWithAMessage) {
  shardit::nn::AttentionBackend no_mask;
  no_mask.name = "test_no_mask";
  no_mask.supports_mask = false;
  no_mask.dtypes = {at::kFloat};
  no_mask.run = [](const shardit::nn::AttentionCall& c) { return shardit::nn::math_attention(c.q, c.k, c.v, c.mask, c.scale); };
  shardit::nn::register_attention_backend(no_mask);
  const at::Tensor q = at::randn({1, 2, 5, 8});
  const at::Tensor mask = at::ones({1, 1, 1, 5}, at::kBool);
  std::string message = error_of([&] { run_with("test_no_mask", q, q, q, mask); });
  EXPECT_NE(message.find("attention backend 'test_no_mask' cannot run this call"), std::string::npos) << message;
  EXPECT_NE(message.find("does not support masks"), std::string::npos) << message;
  message = error_of([&] {
    const at::Tensor h = q.to(at::kBFloat16);
    run_with("test_no_mask", h, h, h, std::nullopt);
  });
  EXPECT_NE(message.find("it takes Float, not BFloat16"), std::string::npos) << message;
  EXPECT_TRUE(tensors_close("accepted call", run_with("test_no_mask", q, q, q, std::nullopt),
                            run_with("math", q, q, q, std::nullopt), 0, 0));
}

TEST(AttentionBackends, SdpaIsRegisteredExactlyWhereLibTorchHasIt) {
  const auto names = shardit::nn::attention_backend_names();
  const bool registered = std::find(names.begin(), names.end(), "sdpa") != names.end();
  EXPECT_EQ(registered, SHARDIT_HAS_SDPA != 0);
  if (!registered) {
    const std::string message = error_of([] { shardit::nn::set_attention_backend("sdpa"); });
    EXPECT_NE(message.find("sdpa needs LibTorch 2.0 or later"), std::string::npos) << message;
  }
}

// The golden transformer cases on each backend: the sample must match math's and diffusers'.
class AttentionBackendsGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(AttentionBackendsGolden, EveryBackendMatchesMathAndTheGoldenSample) {
  const std::string dir = shardit::testing::golden_path(GetParam());
  const auto folder = shardit::io::open_component(dir, "transformer");
  auto model = shardit::models::create_transformer(folder);
  model->load(folder.weights(), {});
  const auto inputs = shardit::io::SafetensorsFile::open(dir + "/inputs.safetensors");
  const at::Tensor golden = shardit::io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample");
  at::Tensor reference;
  {
    AttentionBackendGuard guard("math");
    reference = shardit::verify::forward_from_file(*model, *inputs);
  }
  for (const std::string& backend : shardit::nn::attention_backend_names()) {
    if (backend.rfind("test_", 0) == 0) continue;
    AttentionBackendGuard guard(backend);
    shardit::nn::reset_attention_dispatch_counts();
    if (own_kernel(backend)) {
      // These transformers run in f32, which the bf16 kernels do not take (bf16 golden cases run
      // on them in test_transformers_bf16): a refusal that says so.
      const std::string message = error_of([&] { shardit::verify::forward_from_file(*model, *inputs); });
      EXPECT_NE(message.find("attention backend '" + backend + "' cannot run this call"), std::string::npos) << message;
      EXPECT_NE(message.find("it takes BFloat16, not Float"), std::string::npos) << message;
      continue;
    }
    const at::Tensor sample = shardit::verify::forward_from_file(*model, *inputs);
    const auto counts = shardit::nn::attention_dispatch_counts();
    ASSERT_EQ(counts.size(), 1u) << backend;
    EXPECT_EQ(counts.begin()->first, backend);
    EXPECT_GT(counts.begin()->second, 0);
    EXPECT_TRUE(tensors_close(GetParam() + ": " + backend + " vs math", sample, reference, kGoldenTolerance,
                              kGoldenTolerance));
    EXPECT_TRUE(tensors_close(GetParam() + ": " + backend + " vs golden", sample, golden, kGoldenTolerance,
                              kGoldenTolerance));
  }
}

TEST(AttentionBackendsCli, GoldenCheckBackendsComparesEveryBackendWithMathAndCountsWhatRan) {
  const std::string dir = shardit::testing::golden_path("qwenimage_b2_nonsquare");
  std::string output;
  const int status = shardit::testing::run_command(shardit::testing::cli_path() + " check-backends --model " + dir, &output);
  EXPECT_EQ(status, 0) << output;
  for (const std::string& backend : shardit::nn::attention_backend_names()) {
    if (backend.rfind("test_", 0) == 0) continue;
    EXPECT_NE(output.find(backend), std::string::npos) << output;
    if (own_kernel(backend)) {
      // An f32 model: the bf16 kernels' rows say why they do not apply.
      EXPECT_NE(output.find("it takes BFloat16, not Float"), std::string::npos) << output;
      continue;
    }
    // Each backend's row names the backend that ran, with its number of calls.
    EXPECT_NE(output.find(backend + " x"), std::string::npos) << output;
  }
  EXPECT_EQ(output.find("FAIL"), std::string::npos) << output;
}

TEST(AttentionBackendsCli, UnknownBackendFailsBeforeAnyWork) {
  std::string output;
  const int status = shardit::testing::run_command(
      shardit::testing::cli_path() + " --attention-backend flash9 run-transformer --out /nonexistent/x.safetensors", &output);
  EXPECT_EQ(status, 1) << output;
  EXPECT_NE(output.find("attention backend 'flash9' is not available"), std::string::npos) << output;
}

// The bf16 attention kernels (nn/cpu/bf16_attention.h), each on its own: against the exact attention
// of their bf16 inputs. Their scores are fp32 sums, each row's softmax fp32, the weights rounded
// to bf16 (relative error 2^-9 each) before their product with the values, the output rounded once:
// |out - exact| <= 2^-8 * max|v| + 2^-8 * |exact| covers both roundings with a margin of ~2.
::testing::AssertionResult within_kernel_bound(const std::string& what, const at::Tensor& out, const at::Tensor& exact,
                                            const at::Tensor& v) {
  const at::Tensor o = out.to(at::kDouble), e = exact.to(at::kDouble);
  // [B, H, 1, 1]: the largest |v| of each head
  const at::Tensor v_max = v.to(at::kDouble).abs().amax({2, 3}, /*keepdim=*/true);
  const at::Tensor bound = v_max / 256 + e.abs() / 256;
  const at::Tensor excess = (o - e).abs() - bound;
  const double worst = excess.max().item<double>();
  if (worst <= 0 && at::isfinite(o).all().item<bool>()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": outside the bound by " << worst;
}

/// q, k, v of [B, S, H, D] storage seen as [B, H, S, D] (the transformers' layout), bf16.
at::Tensor heads_view(int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double scale_by = 1.0) {
  return (at::randn({batch, seq, heads, head_dim}) * scale_by).to(at::kBFloat16).transpose(1, 2);
}

class Bf16KernelAttention : public ::testing::TestWithParam<Bf16AttentionKernel> {
 protected:
  Bf16AttentionKernel kernel() const { return GetParam(); }
  std::string kernel_name() const { return shardit::nn::cpu::bf16_attention_kernel_name(GetParam()); }
  shardit::nn::AttentionWithLse run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, double scale) const {
    return shardit::nn::bf16_kernel_attention(kernel(), q, k, v, mask, scale);
  }
};

TEST_P(Bf16KernelAttention, MatchesTheExactAttentionOnOddShapesMasksAndLayouts) {
  const at::Tensor probe = heads_view(1, 4, 1, 32);
  const std::string why = shardit::nn::bf16_kernel_attention_refusal(kernel(), probe, probe, probe, std::nullopt, 0.5);
  if (!kernel_available(kernel())) {
    // Not on this CPU: the refusal names the reason, and auto runs bf16 elsewhere.
    EXPECT_NE(why.find(shardit::nn::cpu::bf16_attention_kernel_unavailable_reason(kernel())), std::string::npos) << why;
    shardit::nn::reset_attention_dispatch_counts();
    run_with("auto", probe, probe, probe, std::nullopt);
    EXPECT_EQ(shardit::nn::attention_dispatch_counts().count(kernel_name()), 0u);
    return;
  }
  ASSERT_EQ(why, "");
  at::manual_seed(21);
  const int64_t chunk = shardit::nn::cpu::attention_blocking(kernel()).key_chunk;
  // Rows and keys below, at and across the 32-row blocks and 32-key steps; head sizes 32-256;
  // a single head (its rows split between threads) and batches of several.
  // Beyond the kernel's key chunk (amx 1536, avx512_bf16 512 keys) the chunks' results merge:
  // 3500 keys are several chunks, and 300 queries more than one group of eight 32-row blocks.
  for (const Shape& s : {Shape{1, 1, 1, 1, 32}, Shape{2, 3, 100, 77, 64}, Shape{1, 2, 33, 130, 128},
                         Shape{1, 1, 65, 31, 256}, Shape{3, 2, 64, 64, 96}, Shape{1, 5, 300, 517, 128},
                         Shape{1, 2, 300, 3500, 64}}) {
    const at::Tensor q = heads_view(s.batch, s.s_q, s.heads, s.head_dim);
    const at::Tensor k = heads_view(s.batch, s.s_kv, s.heads, s.head_dim, 2.0);
    const at::Tensor v = heads_view(s.batch, s.s_kv, s.heads, s.head_dim);
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
    at::Tensor keys = at::rand({s.batch, 1, 1, s.s_kv}) > 0.3;
    keys.select(-1, 0).fill_(true);
    at::Tensor rows = at::rand({s.batch, s.heads, s.s_q, s.s_kv}) > 0.5;
    rows.select(2, 0).fill_(false);  // the first query of every head sees no key
    // Rows whose keys lie in one chunk only (the others all masked), and a row with one key.
    at::Tensor chunks = at::rand({s.batch, s.heads, s.s_q, s.s_kv}) > 0.5;
    if (s.s_q > 3) {
      chunks.select(2, 1).narrow(-1, 0, std::min<int64_t>(s.s_kv, 2 * chunk)).fill_(false);
      chunks.select(2, 2).narrow(-1, std::min<int64_t>(s.s_kv, 100), s.s_kv - std::min<int64_t>(s.s_kv, 100)).fill_(false);
      chunks.select(2, 3).fill_(false);
      chunks.select(2, 3).select(-1, s.s_kv - 1).fill_(true);
    }
    for (const auto& [name, mask] : std::vector<std::pair<std::string, std::optional<at::Tensor>>>{
             {"none", std::nullopt}, {"keys", keys}, {"rows", rows}, {"chunks", chunks}}) {
      const std::string what = kernel_name() + " q " + std::to_string(s.s_q) + " x kv " + std::to_string(s.s_kv) + " x d " +
                               std::to_string(s.head_dim) + ", mask " + name;
      const auto result = run(q, k, v, mask, scale);
      at::Tensor scores = at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-2, -1)) * scale;
      if (mask) scores = scores.masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity());
      // A query with no key: output 0 and lse -inf (as memory_efficient's), where softmax gives NaN.
      const at::Tensor exact = at::matmul(at::softmax(scores, -1), v.to(at::kDouble)).nan_to_num(0.0);
      EXPECT_TRUE(within_kernel_bound(what, result.output, exact, v));
      const at::Tensor lse = at::logsumexp(scores, -1);
      const at::Tensor empty = lse.isneginf();
      EXPECT_TRUE(at::equal(result.lse.isneginf(), empty)) << what;
      EXPECT_TRUE(tensors_close(what + " lse", result.lse.masked_fill(empty, 0.0),
                                lse.masked_fill(empty, 0.0).to(at::kFloat), 1e-4, 1e-5));
      if (name == "rows") {
        EXPECT_EQ(result.output.select(2, 0).abs().max().item<float>(), 0.0f) << what;
      }
    }
  }
}

TEST_P(Bf16KernelAttention, SameBitsWithOneAndTwoThreadsAndANaNStaysInItsRow) {
  if (!kernel_available(kernel())) {
    const at::Tensor q = heads_view(1, 8, 1, 32);
    EXPECT_NE(error_of([&] { run(q, q, q, std::nullopt, 0.5); })
                  .find(kernel_name() + " attention: cannot run this call: " +
                        shardit::nn::cpu::bf16_attention_kernel_unavailable_reason(kernel())),
              std::string::npos);
    return;
  }
  at::manual_seed(22);
  // One head: its 150 rows are split between the threads in runs of 32-row blocks; 2000 keys are
  // several chunks.
  at::Tensor q = heads_view(1, 150, 1, 64);
  const at::Tensor k = heads_view(1, 2000, 1, 64), v = heads_view(1, 2000, 1, 64);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = run(q, k, v, std::nullopt, 0.125);
  at::set_num_threads(std::max(2, threads));
  const auto two = run(q, k, v, std::nullopt, 0.125);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one.output, two.output));
  EXPECT_TRUE(at::equal(one.lse, two.lse));
  q = q.clone();
  q.select(2, 40).select(-1, 3).fill_(std::numeric_limits<float>::quiet_NaN());
  const auto poisoned = run(q, k, v, std::nullopt, 0.125);
  EXPECT_TRUE(at::isnan(poisoned.output.select(2, 40)).all().item<bool>());
  EXPECT_TRUE(std::isnan(poisoned.lse[0][0][40].item<float>()));
  const at::Tensor others = at::cat({poisoned.output.narrow(2, 0, 40), poisoned.output.narrow(2, 41, 109)}, 2);
  EXPECT_TRUE(at::isfinite(others).all().item<bool>());
  EXPECT_TRUE(at::equal(others, at::cat({one.output.narrow(2, 0, 40), one.output.narrow(2, 41, 109)}, 2)));
}

TEST_P(Bf16KernelAttention, AutoTakesBf16CallsItRunsAndRefusalsNameTheCause) {
  // auto takes amx where the CPU has it, else avx512_bf16 where it has that.
  const bool taken_by_auto = auto_kernel() == kernel();
  at::manual_seed(23);
  const at::Tensor q = heads_view(1, 20, 2, 64), k = heads_view(1, 24, 2, 64);
  shardit::nn::reset_attention_dispatch_counts();
  run_with("auto", q, k, k, std::nullopt);
  run_with("auto", q.to(at::kFloat), k.to(at::kFloat), k.to(at::kFloat), std::nullopt);
  auto counts = shardit::nn::attention_dispatch_counts();
  EXPECT_EQ(counts[kernel_name()], taken_by_auto ? 1 : 0);
  EXPECT_EQ(counts["memory_efficient"], auto_kernel() ? 1 : 2);
  // What the start-up line and the bench report: the kernel auto took.
  const std::string reported = shardit::nn::cpu_bf16_attention_backend();
  EXPECT_EQ(reported, auto_kernel() ? shardit::nn::cpu::bf16_attention_kernel_name(*auto_kernel()) : "memory_efficient");
  if (taken_by_auto) {
    EXPECT_EQ(reported, kernel_name());
  }
  if (!kernel_available(kernel())) return;
  const auto refusal = [this](const at::Tensor& qq, const at::Tensor& kk, const std::optional<at::Tensor>& mask) {
    return shardit::nn::bf16_kernel_attention_refusal(kernel(), qq, kk, kk, mask, 0.125);
  };
  EXPECT_EQ(refusal(q.to(at::kFloat), k.to(at::kFloat), std::nullopt), "it takes bf16 on the CPU");
  const at::Tensor q48 = heads_view(1, 20, 2, 48), k48 = heads_view(1, 24, 2, 48);
  EXPECT_NE(refusal(q48, k48, std::nullopt).find("D a multiple of 32"), std::string::npos);
  EXPECT_NE(refusal(q, k, at::zeros({24})).find("not an additive one"), std::string::npos);
  EXPECT_NE(refusal(q, k, at::ones({3, 24}, at::kBool)).find("does not broadcast"), std::string::npos);
  // The kernel's own check too: a 4-D mask whose query rows neither broadcast nor match.
  EXPECT_FALSE(shardit::nn::cpu::bf16_attention_takes(kernel(), q, k, k, at::ones({1, 1, 3, 24}, at::kBool), 0.125));
  EXPECT_TRUE(shardit::nn::cpu::bf16_attention_takes(kernel(), q, k, k, at::ones({1, 2, 20, 24}, at::kBool), 0.125));
  {
    shardit::nn::GemmBackendGuard onednn(shardit::nn::GemmBackend::OneDnn);
    EXPECT_EQ(refusal(q, k, std::nullopt), "--gemm-backend onednn keeps bf16 products on at::linear");
    EXPECT_EQ(shardit::nn::cpu_bf16_attention_backend(), "memory_efficient");
    shardit::nn::reset_attention_dispatch_counts();
    run_with("auto", q, k, k, std::nullopt);
    EXPECT_EQ(shardit::nn::attention_dispatch_counts().count(kernel_name()), 0u);
  }
  // Chosen by name, a call it cannot take fails with the reason instead of running elsewhere.
  const std::string message = error_of([&] { run_with(kernel_name(), q48, k48, k48, std::nullopt); });
  EXPECT_NE(message.find("attention backend '" + kernel_name() + "' cannot run this call"), std::string::npos) << message;
}

TEST_P(Bf16KernelAttention, PartialResultsOverKeyShardsMergeByTheirLogSumExp) {
  // What ring attention does with attention_with_lse: two halves of the keys, merged by lse, on
  // this kernel where it runs (chosen by name: attention_with_lse follows the selection).
  if (!kernel_available(kernel())) return;
  AttentionBackendGuard guard(kernel_name());
  at::manual_seed(24);
  const at::Tensor q = heads_view(1, 70, 3, 64), k = heads_view(1, 100, 3, 64), v = heads_view(1, 100, 3, 64);
  const double scale = 0.125;
  const auto a = shardit::nn::attention_with_lse(q, k.narrow(2, 0, 61), v.narrow(2, 0, 61), std::nullopt, scale);
  const auto b = shardit::nn::attention_with_lse(q, k.narrow(2, 61, 39), v.narrow(2, 61, 39), std::nullopt, scale);
  const at::Tensor lse = at::logaddexp(a.lse, b.lse);
  const at::Tensor merged = a.output.to(at::kDouble) * (a.lse - lse).exp().unsqueeze(-1).to(at::kDouble) +
                            b.output.to(at::kDouble) * (b.lse - lse).exp().unsqueeze(-1).to(at::kDouble);
  const at::Tensor scores = at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-2, -1)) * scale;
  const at::Tensor exact = at::matmul(at::softmax(scores, -1), v.to(at::kDouble));
  // Each part within the kernel's bound of its own exact result; merged, within twice that.
  const at::Tensor v_max = v.to(at::kDouble).abs().amax({2, 3}, /*keepdim=*/true);
  EXPECT_LE(((merged - exact).abs() - (v_max / 128 + exact.abs() / 128)).max().item<double>(), 0.0);
  EXPECT_TRUE(tensors_close("merged lse", lse, at::logsumexp(scores, -1).to(at::kFloat), 1e-4, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Kernels, Bf16KernelAttention, ::testing::ValuesIn(kBf16Kernels),
                         [](const ::testing::TestParamInfo<Bf16AttentionKernel>& info) {
                           return std::string(shardit::nn::cpu::bf16_attention_kernel_name(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(Golden, AttentionBackendsGolden,
                         ::testing::Values("flux_b2_nonsquare", "flux2_b2_nonsquare", "flux2_klein_b2_nonsquare",
                                           "qwenimage_b2_nonsquare"));

}  // namespace
}  // namespace test_attention_backends
