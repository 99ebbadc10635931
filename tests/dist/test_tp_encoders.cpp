// The text encoders under real tensor parallelism: ranks at TP=N (separate processes on this
// host) must give every output of the single-rank run (each hidden state, pooled output, prompt
// embeddings), through both load paths (shard while loading; load whole, then
// enable_parallelism). The golden encoders have 4 heads (TP=2, 4) or 3 (TP=3); Qwen3, Qwen2.5-VL
// and Mistral-3 have 2 key/value heads, so TP=4 replicates each on two ranks (vLLM's rule).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/io/json.h"
#include "shardit/models/mistral/modeling_mistral3.h"
#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/models/registry.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/verify/encoder_case.h"
#include "support/multiprocess.h"
#include "support/qwen_edit_case.h"
#include "support/test_support.h"

namespace test_tp_encoders {
namespace {

using shardit::parallel::ParallelDims;
using shardit::parallel::LoadOptions;
using shardit::parallel::TensorParallelModule;
using shardit::testing::env_or;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;
using ::testing::HasSubstr;

// TP=N may differ from TP=1 only by the order of fp32 sums (each rowwise layer adds N partial
// products), an error that scales with the activations: ~1e-7 to 1e-6 of a tensor's scale. 1e-5
// of max|reference| leaves room for that and fails on any sharding error, which moves values by
// O(scale).
constexpr double kTpScaleTolerance = 1e-5;

std::shared_ptr<TensorParallelModule> load(const std::string& dir, const std::string& path) {
  const auto folder = shardit::io::open_component(dir, "text_encoder");
  auto model = shardit::models::create_text_encoder(folder);
  LoadOptions options;
  if (path == "shard-on-load") {
    options.tensor_parallel = ParallelDims{1, 1, 1, 0}.build(shardit::dist::World::get()).tensor_parallel();
  }
  model->load(folder.weights(), options);
  if (path == "enable-parallelism") {
    model->enable_parallelism(shardit::testing::world_tensor_parallel());
  }
  return model;
}

std::map<std::string, at::Tensor> run_case(TensorParallelModule& model, const std::string& dir) {
  return shardit::verify::run_encoder_case(model, *shardit::io::SafetensorsFile::open(dir + "/inputs.safetensors"));
}

void tp_worker() {
  auto& world = shardit::dist::World::init();
  const std::string dir = env_or("SHARDIT_TP_MODEL");
  const std::string path = env_or("SHARDIT_TP_PATH");
  auto model = load(dir, path);
  const std::map<std::string, at::Tensor> produced = run_case(*model, dir);
  const auto reference = shardit::io::SafetensorsFile::open(env_or("SHARDIT_TP_REFERENCE"));
  size_t compared = 0;
  for (const std::string& name : reference->names()) {
    const at::Tensor expected = reference->read(name).to(at::kDouble);
    const auto it = produced.find(name);
    if (it == produced.end()) {
      ADD_FAILURE() << name << " was not produced at TP=" << world.size();
      continue;
    }
    const double scale = std::max(expected.abs().max().item<double>(), 1.0);
    EXPECT_TRUE(tensors_close(model->type_name() + " " + name + " at TP=" + std::to_string(world.size()) + " (" + path + ")",
                              it->second.to(at::kDouble), expected, kTpScaleTolerance * scale, 0.0));
    ++compared;
  }
  if (world.rank() == 0) std::cout << "compared " << compared << " outputs at TP=" << world.size() << " (" << path << ")\n";
  EXPECT_GE(compared, 5u);
  ASSERT_NE(model->resolved_plan(), nullptr);
  const auto& plan = *model->resolved_plan();
  EXPECT_EQ(plan.tp_degree, world.size());
  EXPECT_EQ(model->parameter_bytes(), plan.bytes_on_rank(world.rank()));
  EXPECT_LT(plan.bytes_on_rank(world.rank()), plan.replicated_bytes() + plan.sharded_bytes());
}

/// Parent: the TP=1 outputs, anchored to transformers' golden tensors, written for the workers
/// (only the names every degree produces: the whole-model-only position_bias and logits are left
/// to the parity suite).
void expect_golden_tp_matches(int nproc, const std::string& golden_case) {
  const std::string dir = golden_path("text/" + golden_case);
  auto model = load(dir, "whole");
  const auto produced = run_case(*model, dir);
  const auto golden = shardit::io::SafetensorsFile::open(dir + "/outputs.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> reference;
  for (const auto& [name, value] : produced) {
    if (name == "position_bias" || name == "logits") continue;
    // left.* / right.* padding rows are compared on tokens only, by the parity suite.
    if (golden->contains(name) && name.rfind("left.", 0) != 0 && name.rfind("right.", 0) != 0) {
      EXPECT_TRUE(tensors_close(name + " at TP=1", value, golden->read(name).to(value.scalar_type()), 1e-4, 1e-4));
    }
    reference.emplace_back(name, value);
  }
  const std::string path = shardit::testing::make_temp_dir("tp-encoder") + "/reference.safetensors";
  shardit::io::save_safetensors(path, reference);
  for (const std::string load_path : {"shard-on-load", "enable-parallelism"}) {
    EXPECT_EQ(run_ranks(nproc, {{"SHARDIT_TP_MODEL", dir}, {"SHARDIT_TP_PATH", load_path}, {"SHARDIT_TP_REFERENCE", path}}), 0)
        << golden_case << " at TP=" << nproc << " through " << load_path;
  }
}

TEST(TpClip, GoldenTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "clip_text");
}

TEST(TpClip, GoldenEosTp3MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(3, "clip_text_eos");
}

TEST(TpT5, GoldenTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "t5_encoder");
}

TEST(TpT5, GoldenTp4MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "t5_encoder");
}

TEST(TpQwen3, GoldenTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "qwen3_klein");
}

TEST(TpQwen3, GoldenTp4ReplicatesKeyValueHeads) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "qwen3_klein");
}

TEST(TpQwen2_5_VL, GoldenTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "qwen2_5_vl_text");
}

TEST(TpQwen2_5_VL, GoldenTp4ReplicatesKeyValueHeads) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "qwen2_5_vl_text");
}

// Qwen2.5-VL with its vision tower (2 heads, so TP=2 splits every vision head pair) on the
// Qwen-Image editing cases (1, 2, 3 images): each rank's image tokens, positions and prompt
// embeddings against transformers' golden tensors, at the parity suite's fp32 tolerance, through
// both load paths.
void vision_worker() {
  auto& world = shardit::dist::World::init();
  const std::string path = env_or("SHARDIT_TP_PATH");
  LoadOptions options;
  if (path == "shard-on-load") {
    options.tensor_parallel = ParallelDims{1, 1, 1, 0}.build(world).tensor_parallel();
  }
  auto model = shardit::testing::load_edit_text_encoder(options);
  if (path == "enable-parallelism") model->enable_parallelism(shardit::testing::world_tensor_parallel());
  ASSERT_NE(model->resolved_plan(), nullptr);
  EXPECT_LT(model->resolved_plan()->spec("visual.blocks.0.attn.qkv.weight").local_shape(world.rank())[0], 96);
  const auto produced = shardit::testing::run_edit_encoder_cases(*model);
  const auto golden = shardit::io::SafetensorsFile::open(golden_path("edit_qwenimage") + "/outputs.safetensors");
  for (const auto& [name, value] : produced) {
    const at::Tensor expected = golden->read(name);
    if (name.find("position_ids") != std::string::npos || name.find("mask") != std::string::npos) {
      EXPECT_TRUE(at::equal(value.to(at::kLong), expected.to(at::kLong))) << name << " at TP=" << world.size();
    } else {
      EXPECT_TRUE(tensors_close(name + " at TP=" + std::to_string(world.size()) + " (" + path + ")", value, expected,
                                1e-4, 1e-4));
    }
  }
  EXPECT_EQ(produced.size(), 12u);
}

TEST(TpQwen2_5_VLVision, GoldenEditEncoderTp2) {
  if (is_worker()) return vision_worker();
  for (const std::string load_path : {"shard-on-load", "enable-parallelism"}) {
    EXPECT_EQ(run_ranks(2, {{"SHARDIT_TP_PATH", load_path}}), 0) << "TP=2 through " << load_path;
  }
}

TEST(TpMistral3, GoldenTp2MatchesTp1) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(2, "mistral3_flux2");
}

TEST(TpMistral3, GoldenTp4ReplicatesKeyValueHeads) {
  if (is_worker()) return tp_worker();
  expect_golden_tp_matches(4, "mistral3_flux2");
}

// ---------------------------------------------------------------------------------------------
// Plans (single process)

std::shared_ptr<TensorParallelModule> create(const std::string& golden_case) {
  return shardit::models::create_text_encoder(shardit::io::open_component(golden_path("text/" + golden_case), "text_encoder"));
}

TEST(TpEncoderPlan, GoldenKeyValueHeadsSplitThenReplicate) {
  auto model = create("qwen3_klein");  // 4 query heads, 2 key/value heads of 16
  const auto at2 = model->resolve(2);
  const auto& k2 = at2.spec("model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(k2.replicas, 1);
  EXPECT_EQ(k2.local_shape(1), (std::vector<int64_t>{16, 48}));
  const auto at4 = model->resolve(4);
  const auto& k4 = at4.spec("model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(k4.replicas, 2);
  // Rank r holds key/value head r / 2 whole.
  const std::vector<int64_t> begins{0, 0, 16, 16};
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(k4.ranges_per_rank[r].size(), 1u);
    EXPECT_EQ(k4.ranges_per_rank[r][0].begin, begins[r]) << "rank " << r;
    EXPECT_EQ(k4.ranges_per_rank[r][0].size(), 16);
  }
  const auto& q4 = at4.spec("model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(q4.local_shape(3), (std::vector<int64_t>{16, 48}));
  // Every rank holds replicated + (sharded + the extra key/value copies) / 4.
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(at4.bytes_on_rank(r), at4.replicated_bytes() + (at4.sharded_bytes() + at4.head_replica_bytes()) / 4);
  }
}

TEST(TpEncoderPlan, GoldenDegreeNeitherDividingNorMultipleOfHeadsListsValidOnes) {
  auto model = create("qwen3_klein");  // 4 query heads, 2 key/value heads, FF 96
  const std::string message = shardit::testing::error_of([&] { model->resolve(3); });
  EXPECT_THAT(message, HasSubstr("does not divide by tp_degree 3"));
  EXPECT_THAT(message, HasSubstr("num_attention_heads = 4"));
  EXPECT_THAT(message, HasSubstr("degrees that would work (up to 64): 1, 2, 4"));
}

TEST(TpEncoderPlan, GoldenInspectPlanShowsReplicatedPlusShardedOverN) {
  for (const auto& [golden_case, tp] : std::vector<std::pair<std::string, int>>{{"clip_text", 2}, {"t5_encoder", 4}, {"qwen3_klein", 2}}) {
    const auto plan = create(golden_case)->resolve(tp);
    const int64_t expected = plan.replicated_bytes() + plan.sharded_bytes() / tp;
    for (int r = 0; r < tp; ++r) EXPECT_EQ(plan.bytes_on_rank(r), expected) << golden_case << " rank " << r;
    std::string output;
    const int status = shardit::testing::run_command(
        shardit::testing::cli_path() + " inspect " + golden_path("text/" + golden_case) + " --plan --tp " + std::to_string(tp),
        &output);
    EXPECT_EQ(status, 0) << output;
    EXPECT_THAT(output, HasSubstr("per rank:   " + std::to_string(expected) + " bytes")) << golden_case;
    EXPECT_THAT(output, HasSubstr("/ " + std::to_string(tp) + " = " + std::to_string(plan.sharded_bytes() / tp)));
  }
}

TEST(TpEncoderPlan, Flux2DevTextEncoderPlanShowsWhatThePipelineLoads) {
  // FLUX.2 [dev]'s real text-encoder config (Mistral-Small-3.1: hidden 5120, 40 layers, 32 q / 8
  // kv heads, FF 32768, vocab 131072): the whole checkpoint and the 30 layers Flux2Pipeline
  // builds, each split by 8 (everything but the norms is sharded).
  const std::string dir = std::string(SHARDIT_SOURCE_DIR) + "/tests/fixtures/configs/flux2_dev_text_encoder";
  const auto config = shardit::io::read_json_file(dir + "/config.json");
  const auto mistral = shardit::models::Mistral3Config::from_json(config, dir);
  auto whole = std::make_shared<shardit::models::Mistral3ForConditionalGeneration>(mistral);
  auto held = shardit::models::flux2_dev_text_encoder(mistral);
  ASSERT_EQ(held->language_model->model->layers->size(), 30u);
  const auto whole_plan = whole->resolve(8, at::kBFloat16);
  const auto held_plan = held->resolve(8, at::kBFloat16);
  EXPECT_LT(held_plan.bytes_on_rank(0), whole_plan.bytes_on_rank(0) * 4 / 5);
  std::string output;
  ASSERT_EQ(shardit::testing::run_command(shardit::testing::cli_path() + " inspect --plan --tp 8 --dtype bf16 " + dir, &output), 0)
      << output;
  EXPECT_THAT(output, HasSubstr("(layers 1-30 of 40, as Flux2Pipeline loads it)"));
  EXPECT_THAT(output, HasSubstr("| 8 | 22.901B |"));
  EXPECT_THAT(output, HasSubstr("| 8 | 17.344B |"));
  EXPECT_THAT(output, HasSubstr("not added to the totals"));
  // The totals count the checkpoint once.
  EXPECT_THAT(output, HasSubstr("all components, plan 'full': 2.863B parameters"));
}

TEST(TpEncoderPlan, GoldenRealQwenImageEdit2511TextEncoderCountsTheVisionTower) {
  // Qwen-Image-Edit-2511's text encoder (Qwen2.5-VL-7B: 28 query / 4 key-value heads of 128, FF
  // 18944, vocab 152064; vision tower of 32 blocks, 1280 wide, 16 heads, FF 3420, merger to
  // 3584). Its pipeline folder lists a `processor`, so the registry builds the tower: 7.75B
  // parameters without lm_head, of which the tower holds 0.68B. TP 2 and 4 shard both; TP 8 is
  // refused by the text model's 28 heads, listing 1, 2, 4.
  const std::string dir = std::string(SHARDIT_SOURCE_DIR) + "/tests/fixtures/configs/qwen_image_edit_2511";
  auto model = shardit::models::create_text_encoder(shardit::io::open_component(dir, "text_encoder"));
  const auto* vl = dynamic_cast<shardit::models::Qwen2_5_VLForConditionalGeneration*>(model.get());
  ASSERT_NE(vl, nullptr);
  ASSERT_NE(vl->visual, nullptr);
  int64_t tower = 0;
  for (const auto& slot : vl->visual->named_states()) tower += slot.tensor->numel();
  EXPECT_NEAR(static_cast<double>(tower), 0.6766e9, 0.001e9);
  const auto at2 = model->resolve(2, at::kBFloat16);
  const auto at4 = model->resolve(4, at::kBFloat16);
  EXPECT_EQ(at2.replicated_bytes() + at2.sharded_bytes(), at4.replicated_bytes() + at4.sharded_bytes());
  EXPECT_NEAR(static_cast<double>(at2.replicated_bytes() + at2.sharded_bytes()) / 2, 7.747e9, 0.01e9);
  EXPECT_LT(at4.bytes_on_rank(0), at2.bytes_on_rank(0) * 6 / 10);
  EXPECT_EQ(at4.spec("visual.blocks.0.attn.qkv.weight").local_shape(0), (std::vector<int64_t>{960, 1280}));
  const std::string message = shardit::testing::error_of([&] { model->resolve(8, at::kBFloat16); });
  EXPECT_THAT(message, HasSubstr("degrees that would work (up to 64): 1, 2, 4"));
  // The text-to-image folder's encoder (no processor) keeps the tower out.
  const auto t2i = shardit::models::create_text_encoder(
      shardit::io::open_component(golden_path("pipeline_qwenimage"), "text_encoder"));
  EXPECT_EQ(dynamic_cast<shardit::models::Qwen2_5_VLForConditionalGeneration*>(t2i.get())->visual, nullptr);
}

TEST(RunEncoderCli, GoldenTp2WritesEveryGoldenOutput) {
  // The CLI at TP=2 writes the golden names, with the golden values.
  const std::string dir = golden_path("text/clip_text");
  const std::string out = shardit::testing::make_temp_dir("run-encoder") + "/outputs.safetensors";
  std::string output;
  const int status = shardit::testing::run_command(
      shardit::testing::cli_path() + " --nproc-per-node 2 run-encoder --model " + dir + " --inputs " + dir + " --out " + out,
      &output);
  ASSERT_EQ(status, 0) << output;
  const auto written = shardit::io::SafetensorsFile::open(out);
  const auto golden = shardit::io::SafetensorsFile::open(dir + "/outputs.safetensors");
  for (const std::string& name : golden->names()) {
    ASSERT_TRUE(written->contains(name)) << name << " not written";
    EXPECT_TRUE(tensors_close(name, written->read(name), golden->read(name), 1e-4, 1e-4));
  }
}

}  // namespace
}  // namespace test_tp_encoders
