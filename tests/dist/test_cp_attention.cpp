// Ulysses and ring attention alone, in real multi-process runs: the joint attention of a text and
// an image stream (odd lengths, so both are padded; a text key mask; RoPE rows split with their
// tokens) under context parallelism must equal the single-rank math path, for ulysses and ring
// degrees 2 and 3 and their 2 x 2 combination. Also the ring shift itself and the refusal of head
// counts that tp x ulysses does not divide.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/parallel/context_parallel.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_cp_attention {
namespace {

using shardit::parallel::ContextParallelConfig;
using shardit::parallel::ContextParallelForward;
using shardit::parallel::CpAction;
using shardit::parallel::CpPlan;
using shardit::parallel::SequenceStream;
using shardit::testing::env_or;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;
using ::testing::HasSubstr;

// Shapes: 6 heads split by ulysses 2 and 3; 5 text and 7 image tokens, which no degree above 1
// divides, so every run pads both streams.
constexpr int64_t kBatch = 2, kHeads = 6, kHeadDim = 8, kText = 5, kImage = 7;

struct Streams {
  shardit::nn::HeadsQKV text, image;
  shardit::nn::RotaryEmbedding text_rope, image_rope;
  at::Tensor text_mask;  ///< bool [B, L]
};

Streams make_streams() {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1601);
  const auto randn = [&](std::vector<int64_t> shape) {
    return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kFloat));
  };
  const auto heads = [&](int64_t len) {
    return shardit::nn::HeadsQKV{randn({kBatch, len, kHeads, kHeadDim}), randn({kBatch, len, kHeads, kHeadDim}),
                                 randn({kBatch, len, kHeads, kHeadDim})};
  };
  const auto rope = [&](int64_t len) {
    // [S, D]: each angle repeated for its channel pair
    const at::Tensor angles = randn({len, kHeadDim / 2}).repeat_interleave(2, 1);
    return shardit::nn::RotaryEmbedding{angles.cos(), angles.sin()};
  };
  Streams s{heads(kText), heads(kImage), rope(kText), rope(kImage), at::Tensor()};
  // Sample 0 attends every text token, sample 1 only the first two (as a padded prompt).
  s.text_mask = at::ones({kBatch, kText}, at::kBool);
  s.text_mask[1].slice(0, 2).fill_(false);
  return s;
}

/// [B, L + N] bool: the text mask, then every image token.
at::Tensor joint_key_mask(const at::Tensor& text_mask, int64_t image_len) {
  return at::cat({text_mask, at::ones({text_mask.size(0), image_len}, text_mask.options())}, 1);
}

const CpPlan& test_plan() {
  static const CpPlan plan = {
      {"text.q", CpAction::Split, 1, SequenceStream::Text},    {"text.k", CpAction::Split, 1, SequenceStream::Text},
      {"text.v", CpAction::Split, 1, SequenceStream::Text},    {"text.mask", CpAction::Split, 1, SequenceStream::Text},
      {"text.cos", CpAction::Split, 0, SequenceStream::Text},  {"text.sin", CpAction::Split, 0, SequenceStream::Text},
      {"image.q", CpAction::Split, 1, SequenceStream::Image},  {"image.k", CpAction::Split, 1, SequenceStream::Image},
      {"image.v", CpAction::Split, 1, SequenceStream::Image},  {"image.cos", CpAction::Split, 0, SequenceStream::Image},
      {"image.sin", CpAction::Split, 0, SequenceStream::Image}, {"text.out", CpAction::Gather, 1, SequenceStream::Text},
      {"image.out", CpAction::Gather, 1, SequenceStream::Image},
  };
  return plan;
}

void attention_worker() {
  auto& world = shardit::dist::World::init();
  const int cfg = std::stoi(env_or("SHARDIT_CP_CFG", "1"));
  const int ulysses = std::stoi(env_or("SHARDIT_CP_ULYSSES"));
  const int ring = std::stoi(env_or("SHARDIT_CP_RING"));
  ASSERT_EQ(cfg * ulysses * ring, world.size());
  // The shared convention: cfg x ulysses x ring (x tp), row-major; each cfg half is its own CP group.
  const shardit::dist::DeviceMesh mesh(world, {{"cfg", cfg}, {"ulysses", ulysses}, {"ring", ring}});
  const ContextParallelConfig config(mesh);
  const Streams s = make_streams();

  // The reference: the whole sequences on one rank, math backend.
  at::Tensor expected_text, expected_image;
  {
    const shardit::nn::AttentionBackendGuard math("math");
    std::tie(expected_text, expected_image) = shardit::nn::joint_attention(
        s.text, s.image, &s.text_rope, &s.image_rope, joint_key_mask(s.text_mask, kImage));
  }

  ContextParallelForward cp(config, test_plan(), "test");
  const auto split = [&](const std::string& stream, const shardit::nn::HeadsQKV& qkv) {
    return shardit::nn::HeadsQKV{cp.point(stream + ".q", qkv.query), cp.point(stream + ".k", qkv.key),
                                 cp.point(stream + ".v", qkv.value)};
  };
  const shardit::nn::HeadsQKV text = split("text", s.text);
  const shardit::nn::HeadsQKV image = split("image", s.image);
  const shardit::nn::RotaryEmbedding text_rope{cp.point("text.cos", s.text_rope.cos), cp.point("text.sin", s.text_rope.sin)};
  const shardit::nn::RotaryEmbedding image_rope{cp.point("image.cos", s.image_rope.cos),
                                                cp.point("image.sin", s.image_rope.sin)};
  const at::Tensor text_mask = cp.point("text.mask", s.text_mask);
  EXPECT_EQ(text.query.size(1), (kText + config.cp_degree() - 1) / config.cp_degree());
  const auto [text_local, image_local] =
      shardit::nn::joint_attention(text, image, &text_rope, &image_rope, joint_key_mask(text_mask, image.query.size(1)));
  const at::Tensor text_out = cp.point("text.out", text_local);
  const at::Tensor image_out = cp.point("image.out", image_local);

  // The merge reorders fp32 sums over at most a dozen keys: a few ulp of |out| <= ~3.
  const std::string mesh_name = "ulysses=" + std::to_string(ulysses) + " x ring=" + std::to_string(ring);
  EXPECT_TRUE(tensors_close("text attention at " + mesh_name, text_out, expected_text, 1e-5, 1e-5));
  EXPECT_TRUE(tensors_close("image attention at " + mesh_name, image_out, expected_image, 1e-5, 1e-5));
  // Ring attention's transfers are counted: (ring - 1) shifts of one block per call.
  EXPECT_EQ(config.ring_group->stats().calls_by_op["ring_shift"], static_cast<uint64_t>(ring > 1 ? ring - 1 : 0));
  if (ulysses > 1) {
    // q, k, v there (one exchange) and the output back.
    EXPECT_EQ(config.ulysses_group->stats().calls_by_op["all_to_all"], 2u);
  }
}

void expect_attention_matches(int ulysses, int ring, int cfg = 1) {
  EXPECT_EQ(run_ranks(cfg * ulysses * ring, {{"SHARDIT_CP_CFG", std::to_string(cfg)},
                                             {"SHARDIT_CP_ULYSSES", std::to_string(ulysses)},
                                             {"SHARDIT_CP_RING", std::to_string(ring)}}),
            0)
      << "cfg=" << cfg << " ulysses=" << ulysses << " ring=" << ring;
}

TEST(CpAttention, Ulysses2MatchesMath) {
  if (is_worker()) return attention_worker();
  expect_attention_matches(2, 1);
}

TEST(CpAttention, Ring2MatchesMath) {
  if (is_worker()) return attention_worker();
  expect_attention_matches(1, 2);
}

TEST(CpAttention, Ulysses3MatchesMath) {
  if (is_worker()) return attention_worker();
  expect_attention_matches(3, 1);
}

TEST(CpAttention, Ring3MatchesMath) {
  if (is_worker()) return attention_worker();
  expect_attention_matches(1, 3);
}

TEST(CpAttention, Ulysses2Ring2MatchesMath) {
  if (is_worker()) return attention_worker();
  expect_attention_matches(2, 2);
}

TEST(CpAttention, Cfg2Ring2MatchesMath) {
  if (is_worker()) return attention_worker();
  expect_attention_matches(1, 2, 2);
}

// ---------------------------------------------------------------------------------------------
// The ring shift: member r receives member r - 1's tensor, and the bytes sent are counted.

TEST(CpAttention, RingShiftPassesToTheNextMember) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    auto group = world.group();
    const at::Tensor send = at::full({3, 2}, static_cast<float>(world.rank()));
    at::Tensor recv = at::empty_like(send);
    const uint64_t bytes_before = group->stats().bytes_sent;
    group->ring_shift_async(send, recv).wait();
    const int previous = (world.rank() + world.size() - 1) % world.size();
    EXPECT_TRUE(recv.equal(at::full({3, 2}, static_cast<float>(previous))));
    EXPECT_EQ(group->stats().bytes_sent - bytes_before, 6u * 4u);
    // A strided destination is written too.
    at::Tensor strided = at::empty({2, 3}).t();
    group->ring_shift_async(send, strided).wait();
    EXPECT_TRUE(strided.equal(at::full({3, 2}, static_cast<float>(previous))));
    at::Tensor wrong = at::empty({2, 2});
    EXPECT_THAT(shardit::testing::error_of([&] { group->ring_shift_async(send, wrong); }),
                HasSubstr("ring_shift on group"));
    return;
  }
  EXPECT_EQ(run_ranks(3), 0);
}

// ---------------------------------------------------------------------------------------------
// Refusals

TEST(CpAttention, HeadsNotDividingTpTimesUlyssesAreRefusedListingPairs) {
  const std::string message = shardit::testing::error_of(
      [] { shardit::parallel::check_context_parallel_heads("FluxTransformer2DModel", "num_attention_heads", 4, 2, 3); });
  EXPECT_THAT(message, HasSubstr("FluxTransformer2DModel: num_attention_heads = 4 does not divide by tp x ulysses = 2 x 3 = 6"));
  EXPECT_THAT(message, HasSubstr("(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1)"));
}

TEST(CpAttention, HeadsDividingTpTimesUlyssesAreAccepted) {
  shardit::parallel::check_context_parallel_heads("M", "num_attention_heads", 24, 2, 3);
  shardit::parallel::check_context_parallel_heads("M", "num_attention_heads", 6, 1, 3);
}

TEST(CpAttention, PointOutsideThePlanIsRefused) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    const shardit::dist::DeviceMesh mesh(world, {{"ring", 2}});
    ContextParallelForward cp(ContextParallelConfig(mesh), test_plan(), "TestModel");
    EXPECT_THAT(shardit::testing::error_of([&] { cp.point("hidden_states", at::zeros({1, 3, 2})); }),
                HasSubstr("TestModel: the forward marks a context-parallel point 'hidden_states'"));
    // A gather before its stream was split.
    EXPECT_THAT(shardit::testing::error_of([&] { cp.point("image.out", at::zeros({1, 3, 2})); }),
                HasSubstr("was never reached"));
    // No rank exits while another still connects the mesh's groups (nothing else here talks).
    world.group()->barrier();
    return;
  }
  EXPECT_EQ(run_ranks(2), 0);
}

}  // namespace
}  // namespace test_cp_attention
