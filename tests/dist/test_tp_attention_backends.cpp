// Attention backends under real tensor parallelism (separate processes on this host): each rank
// holds its heads, so every backend runs on the local heads and must give math's result for them.
// The golden transformers at TP=2 on each backend against the TP=1 math sample, and random
// q/k/v with masks (per key, per head, per query) split by heads as a colwise projection splits
// them.
//
// Tolerance: the golden one (1e-4 absolute + relative): TP=2 reorders the rowwise sums (~1e-6 of
// the scale) and a backend reorders the softmax sums (~1e-7); a sharding or masking error moves
// values by O(scale).
#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <string>

#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/attention/bf16_kernels.h"
#include "shardit/nn/cpu/bf16_attention.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/verify/transformer_case.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_tp_attention_backends {
namespace {

using shardit::nn::AttentionBackendGuard;
using shardit::testing::env_or;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;

constexpr double kTolerance = 1e-4;

at::Tensor golden_forward(const std::string& dir, bool sharded) {
  const auto folder = shardit::io::open_component(dir, "transformer");
  auto model = shardit::models::create_transformer(folder);
  shardit::parallel::LoadOptions options;
  if (sharded) {
    auto& world = shardit::dist::World::get();
    options.tensor_parallel = shardit::parallel::ParallelDims{1, 1, 1, 0}.build(world).tensor_parallel();
  }
  model->load(folder.weights(), options);
  const auto inputs = shardit::io::SafetensorsFile::open(dir + "/inputs.safetensors");
  if (!sharded) {
    AttentionBackendGuard guard("math");
    return shardit::verify::forward_from_file(*model, *inputs);
  }
  auto& world = shardit::dist::World::get();
  const at::Tensor reference = shardit::io::SafetensorsFile::open(env_or("SHARDIT_ATTN_REFERENCE"))->read("sample");
  for (const std::string& backend : shardit::nn::attention_backend_names()) {
    AttentionBackendGuard guard(backend);
    shardit::nn::reset_attention_dispatch_counts();
    if (backend == "amx" || backend == "avx512_bf16") {
      // f32 transformers: the bf16 kernels refuse them with the reason; their sharded heads are
      // checked in bf16 below.
      const std::string message =
          shardit::testing::error_of([&] { shardit::verify::forward_from_file(*model, *inputs); });
      EXPECT_NE(message.find("it takes BFloat16, not Float"), std::string::npos) << message;
      continue;
    }
    const at::Tensor sample = shardit::verify::forward_from_file(*model, *inputs);
    EXPECT_EQ(shardit::nn::attention_dispatch_counts().count(backend), 1u) << backend << " did not run";
    const auto result = tensors_close(dir + " at TP=" + std::to_string(world.size()) + " on " + backend + " vs TP=1 math",
                                      sample, reference, kTolerance, kTolerance);
    EXPECT_TRUE(result);
    if (world.rank() == 0) std::cout << backend << ": " << result.message() << "\n";
  }
  return {};
}

void golden_worker() {
  shardit::dist::World::init();
  golden_forward(env_or("SHARDIT_ATTN_MODEL"), /*sharded=*/true);
}

void expect_golden_tp2(const std::string& golden_case) {
  const std::string dir = golden_path(golden_case);
  const at::Tensor reference = golden_forward(dir, /*sharded=*/false);
  const std::string path = shardit::testing::make_temp_dir("attn-reference") + "/reference.safetensors";
  shardit::io::save_safetensors(path, {{"sample", reference}});
  EXPECT_EQ(run_ranks(2, {{"SHARDIT_ATTN_MODEL", dir}, {"SHARDIT_ATTN_REFERENCE", path}}), 0);
}

TEST(TpAttentionBackends, GoldenFluxTp2EveryBackendMatchesMath) {
  if (is_worker()) return golden_worker();
  expect_golden_tp2("flux_b2_nonsquare");
}

TEST(TpAttentionBackends, GoldenFlux2Tp2EveryBackendMatchesMath) {
  if (is_worker()) return golden_worker();
  expect_golden_tp2("flux2_b2_nonsquare");
}

TEST(TpAttentionBackends, GoldenQwenImageTp2EveryBackendMatchesMath) {
  if (is_worker()) return golden_worker();
  expect_golden_tp2("qwenimage_b2_nonsquare");
}

// Every rank draws the same full tensors (same seed), keeps its contiguous share of the heads,
// runs each backend on it and compares with the rank's share of math over all heads.
void random_heads_worker() {
  auto& world = shardit::dist::World::init();
  const int64_t heads = 6, local = heads / world.size();
  at::manual_seed(21);
  const at::Tensor q = at::randn({2, heads, 150, 32}), k = at::randn({2, heads, 700, 32}) * 2,
                   v = at::randn({2, heads, 700, 32});
  at::Tensor keys = at::rand({2, 1, 1, 700}) > 0.3;
  keys.select(-1, 0).fill_(true);
  const at::Tensor per_head = at::randn({heads, 1, 700});
  at::Tensor per_query = at::rand({2, heads, 150, 700}) > 0.5;
  per_query.select(-1, 699).fill_(true);
  const int64_t h0 = world.rank() * local;
  const auto mine = [&](const at::Tensor& t) { return t.narrow(1, h0, local); };
  const std::vector<std::pair<std::string, at::Tensor>> masks = {
      {"bool keys", keys}, {"additive per head", per_head.narrow(0, h0, local)}, {"bool per query", mine(per_query)}};
  const std::vector<at::Tensor> full_masks = {keys, per_head, per_query};
  for (const std::string& backend : shardit::nn::attention_backend_names()) {
    if (backend == "amx" || backend == "avx512_bf16") continue;  // bf16 only: bf16_kernel_heads_worker
    for (size_t i = 0; i < masks.size(); ++i) {
      at::Tensor expected;
      {
        AttentionBackendGuard guard("math");
        expected = mine(shardit::nn::scaled_dot_product_attention(q, k, v, full_masks[i]));
      }
      AttentionBackendGuard guard(backend);
      const at::Tensor got = shardit::nn::scaled_dot_product_attention(mine(q), mine(k), mine(v), masks[i].second);
      EXPECT_TRUE(tensors_close(backend + ", rank " + std::to_string(world.rank()) + ", mask " + masks[i].first, got,
                                expected, 1e-5, 1e-5));
    }
  }
}

TEST(TpAttentionBackends, RandomShapesWithMasksTp2EveryBackendMatchesMath) {
  if (is_worker()) return random_heads_worker();
  EXPECT_EQ(run_ranks(2), 0);
}

// The bf16 kernel auto takes (amx, else avx512_bf16) on each rank's share of the heads, against the
// exact attention (float64) of all heads' bf16 inputs: within its rounding bound (2^-8 of the
// largest |v| of the head plus 2^-8 of the output; nn/cpu/bf16_attention.h). Where the CPU has
// neither, each rank checks that auto ran its bf16 heads elsewhere.
void bf16_kernel_heads_worker() {
  auto& world = shardit::dist::World::init();
  const int64_t heads = 6, local = heads / world.size();
  at::manual_seed(22);
  // [B, S, H, D] storage seen as [B, H, S, D], as the transformers lay them out
  const auto heads_view = [&](int64_t seq) { return at::randn({2, seq, heads, 64}).to(at::kBFloat16).transpose(1, 2); };
  const at::Tensor q = heads_view(150), k = heads_view(700), v = heads_view(700);
  at::Tensor keys = at::rand({2, 1, 1, 700}) > 0.3;
  keys.select(-1, 0).fill_(true);
  const int64_t h0 = world.rank() * local;
  const auto mine = [&](const at::Tensor& t) { return t.narrow(1, h0, local); };
  shardit::nn::reset_attention_dispatch_counts();
  for (const std::optional<at::Tensor>& mask : {std::optional<at::Tensor>{}, std::optional<at::Tensor>{keys}}) {
    at::Tensor scores = at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-2, -1)) / 8.0;
    if (mask) scores = scores.masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity());
    const at::Tensor exact = mine(at::matmul(at::softmax(scores, -1), v.to(at::kDouble)));
    AttentionBackendGuard guard("auto");
    const at::Tensor got = shardit::nn::scaled_dot_product_attention(mine(q), mine(k), mine(v), mask).to(at::kDouble);
    const at::Tensor bound = mine(v).to(at::kDouble).abs().amax({2, 3}, true) / 256 + exact.abs() / 256;
    EXPECT_LE(((got - exact).abs() - bound).max().item<double>(), 0.0)
        << "rank " << world.rank() << (mask ? ", bool keys" : ", no mask");
  }
  const auto counts = shardit::nn::attention_dispatch_counts();
  int kernel_calls = 0, expected_calls = 0;
  for (const auto kernel : {shardit::nn::cpu::Bf16AttentionKernel::amx, shardit::nn::cpu::Bf16AttentionKernel::avx512_bf16}) {
    const std::string name = shardit::nn::cpu::bf16_attention_kernel_name(kernel);
    kernel_calls += counts.count(name) == 1 ? counts.at(name) : 0;
    if (expected_calls == 0 &&
        shardit::nn::bf16_kernel_attention_refusal(kernel, mine(q), mine(k), mine(v), std::nullopt, 0.125).empty()) {
      expected_calls = 2;
      EXPECT_EQ(counts.count(name) == 1 ? counts.at(name) : 0, 2) << name << ", rank " << world.rank();
    }
  }
  EXPECT_EQ(kernel_calls, expected_calls) << "rank " << world.rank();
}

TEST(TpAttentionBackends, Bf16KernelHeadsTp2WithinTheKernelsBoundOfTheExactAttention) {
  if (is_worker()) return bf16_kernel_heads_worker();
  EXPECT_EQ(run_ranks(2), 0);
}

}  // namespace
}  // namespace test_tp_attention_backends
