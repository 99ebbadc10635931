// The three transformers under context parallelism, composed with tensor parallelism: every mesh
// of standard_cp_meshes() (tp, ulysses, ring up to 4 ranks) must give the single-rank sample
// within the golden tolerance. The models are the golden configs and weights (4 heads, so
// tp x ulysses = 4 still holds whole heads); the inputs have odd text and image lengths, so every
// CP degree pads both streams, and a batch of 2. Qwen-Image runs its golden inputs, whose second
// sample has a padded prompt (the text mask must travel with its keys).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/flux2/transformer_flux2.h"
#include "shardit/models/qwen_image/transformer_qwenimage.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/context_parallel_case.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_cp_transformers {
namespace {

using shardit::parallel::TensorParallelModule;
using shardit::testing::ContextParallelCase;
using shardit::testing::context_parallel_worker;
using shardit::testing::expect_context_parallel_matches;
using shardit::testing::golden_path;
using shardit::testing::is_worker;

// B = 2, a 3 x 5 token grid (15 image tokens) and 7 text tokens: odd, so CP degrees 2 and 4 pad.
constexpr int64_t kBatch = 2, kRows = 3, kCols = 5, kText = 7;

at::Tensor randn(at::Generator& generator, std::vector<int64_t> shape) {
  return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kFloat));
}

/// [N, axes]: (0, row, col[, 0]) per token of the grid, row-major.
at::Tensor grid_ids(int64_t axes) {
  const at::Tensor rows = at::arange(kRows).repeat_interleave(kCols);
  const at::Tensor cols = at::arange(kCols).repeat({kRows});
  at::Tensor ids = at::zeros({kRows * kCols, axes}, at::kLong);
  ids.select(1, 1).copy_(rows);
  ids.select(1, 2).copy_(cols);
  return ids;
}

std::function<std::shared_ptr<TensorParallelModule>()> golden_model(const std::string& golden_case) {
  return [golden_case] { return shardit::testing::load_transformer(golden_path(golden_case)); };
}

ContextParallelCase flux_case() {
  ContextParallelCase c;
  c.load_model = golden_model("flux_b2_nonsquare");
  c.forward = [](TensorParallelModule& module) {
    auto& model = dynamic_cast<shardit::models::FluxTransformer2DModel&>(module);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1611);
    shardit::models::FluxTransformer2DModelInputs inputs;
    inputs.hidden_states = randn(generator, {kBatch, kRows * kCols, model.config.in_channels});
    inputs.encoder_hidden_states = randn(generator, {kBatch, kText, model.config.joint_attention_dim});
    inputs.pooled_projections = randn(generator, {kBatch, model.config.pooled_projection_dim});
    inputs.timestep = at::tensor({0.7f, 0.3f});
    inputs.guidance = at::tensor({3.5f, 4.0f});
    inputs.img_ids = grid_ids(3).to(at::kFloat);
    // Distinct text positions, so a text token's rotary row matters.
    inputs.txt_ids = at::zeros({kText, 3});
    inputs.txt_ids.select(1, 0).copy_(at::arange(kText));
    return model.forward(inputs);
  };
  return c;
}

ContextParallelCase flux2_case() {
  ContextParallelCase c;
  c.load_model = golden_model("flux2_b2_nonsquare");
  c.forward = [](TensorParallelModule& module) {
    auto& model = dynamic_cast<shardit::models::Flux2Transformer2DModel&>(module);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1612);
    shardit::models::Flux2Transformer2DModelInputs inputs;
    inputs.hidden_states = randn(generator, {kBatch, kRows * kCols, model.config.in_channels});
    inputs.encoder_hidden_states = randn(generator, {kBatch, kText, model.config.joint_attention_dim});
    inputs.timestep = at::tensor({0.7f, 0.3f});
    inputs.guidance = at::tensor({3.5f, 4.0f});
    // [B, N, 4] (0, row, col, 0) and [B, L, 4] (0, 0, 0, l), as the pipeline builds them
    inputs.img_ids = grid_ids(4).unsqueeze(0).expand({kBatch, -1, -1}).contiguous();
    at::Tensor txt_ids = at::zeros({kText, 4}, at::kLong);
    txt_ids.select(1, 3).copy_(at::arange(kText));
    inputs.txt_ids = txt_ids.unsqueeze(0).expand({kBatch, -1, -1}).contiguous();
    return model.forward(inputs);
  };
  return c;
}

ContextParallelCase qwenimage_case(const std::string& name) {
  ContextParallelCase c;
  c.load_model = golden_model(name);
  c.forward = [name](TensorParallelModule& model) { return shardit::testing::run_case(model, golden_path(name)); };
  return c;
}

TEST(CpFlux, GoldenOddLengthsMatchSingleRankOnEveryMesh) {
  const ContextParallelCase c = flux_case();
  if (is_worker()) return context_parallel_worker(c);
  expect_context_parallel_matches(c);
}

TEST(CpFlux2, GoldenOddLengthsMatchSingleRankOnEveryMesh) {
  const ContextParallelCase c = flux2_case();
  if (is_worker()) return context_parallel_worker(c);
  expect_context_parallel_matches(c);
}

// B = 2, a 3 x 5 grid, 7 text tokens, sample 1 with 4 valid ones.
TEST(CpQwenImage, GoldenMaskedTextMatchesSingleRankOnEveryMesh) {
  const ContextParallelCase c = qwenimage_case("qwenimage_b2_nonsquare");
  if (is_worker()) return context_parallel_worker(c);
  expect_context_parallel_matches(c);
}

// zero_cond_t (Qwen-Image-Edit-2511): 29 image tokens in three grids, the reference-token mask
// split with them, so a rank's share can start inside a reference grid.
TEST(CpQwenImage, GoldenZeroCondTMatchesSingleRankOnEveryMesh) {
  const ContextParallelCase c = qwenimage_case("qwenimage_edit_zero_cond_t_b2");
  if (is_worker()) return context_parallel_worker(c);
  expect_context_parallel_matches(c);
}

// bf16 weights and activations: the exchanged q/k/v, the ring's packed [k | v | mask] blocks and
// the gathered sample travel in bf16 (the merge runs in fp32). Against the single-rank bf16
// forward the difference is bf16 rounding of differently ordered sums: ~1e-2 of |sample| <= 4.
TEST(CpFlux, GoldenBf16MatchesSingleRankUnderUlyssesAndRing) {
  ContextParallelCase c = flux_case();
  const auto load_fp32 = c.load_model;
  c.load_model = [load_fp32] {
    auto model = load_fp32();
    model->to(at::kCPU, at::kBFloat16);
    return model;
  };
  c.atol = 5e-2;
  c.rtol = 2e-2;
  if (is_worker()) return context_parallel_worker(c);
  expect_context_parallel_matches(c, {{1, 2, 1}, {1, 1, 2}});
}

// 4 heads cannot be split by tp x ulysses = 1 x 3: refused when context parallelism is enabled,
// before any forward, listing the pairs that work; the ring degree is free.
TEST(CpFlux, GoldenHeadsNotDividingTpTimesUlyssesAreRefused) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    const shardit::dist::DeviceMesh mesh(world, {{"ulysses", 3}});
    auto model = golden_model("flux_b1_square")();
    const std::string message = shardit::testing::error_of(
        [&] { model->enable_context_parallelism(shardit::parallel::ContextParallelConfig(mesh)); });
    EXPECT_THAT(message, ::testing::HasSubstr("FluxTransformer2DModel: num_attention_heads = 4 does not divide by "
                                              "tp x ulysses = 1 x 3 = 3"));
    EXPECT_THAT(message, ::testing::HasSubstr("(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1)"));
    EXPECT_EQ(model->context_parallel_config(), nullptr);
    const shardit::dist::DeviceMesh ring_mesh(world, {{"ring", 3}});
    model->enable_context_parallelism(shardit::parallel::ContextParallelConfig(ring_mesh));
    EXPECT_EQ(model->context_parallel_config()->ring_degree(), 3);
    // No rank exits while another is still connecting the ring group's pairs.
    world.group()->barrier();
    return;
  }
  EXPECT_EQ(shardit::testing::run_ranks(3), 0);
}

}  // namespace
}  // namespace test_cp_transformers
