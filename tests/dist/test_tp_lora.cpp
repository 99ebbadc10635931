// LoRA adapters under real tensor parallelism, on every golden LoRA case: each rank reads its
// slices of the adapters by the model's plan, through both load paths (shard while loading; load
// whole, then enable_parallelism). Unfused, the sample (and sample_scaled) must match diffusers;
// fused, every rank's merged weights must equal its slice of diffusers' merged weights and the
// sample must match sample_fused. Samples: 1e-4 + 1e-4|b| as at TP=1 (the TP sum order moves them
// by ~1e-6 of their scale, see test_tp_transformers.cpp); merged weights: 1e-6 absolute.
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "shardit/dist/world.h"
#include "shardit/models/builtin.h"
#include "shardit/models/lora_formats.h"
#include "shardit/io/safetensors.h"
#include "shardit/nn/linear.h"
#include "shardit/parallel/lora.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/verify/lora_case.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_tp_lora {
namespace {

using shardit::parallel::TensorParallelModule;
using shardit::testing::env_or;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::load_transformer;
using shardit::testing::run_case;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;

constexpr double kTol = 1e-4;
constexpr double kMergedTol = 1e-6;

const std::vector<std::string> kCases = {
    "lora_flux1_peft",  "lora_flux1_two_adapters", "lora_flux1_kohya",    "lora_flux1_xlabs",
    "lora_flux2_peft",  "lora_flux2_two_adapters", "lora_flux2_bfl",      "lora_qwenimage_peft",
    "lora_qwenimage_two_adapters", "lora_qwenimage_kohya"};

void check_case(const std::string& dir, const std::string& path) {
  auto& world = shardit::dist::World::get();
  const std::string what = dir.substr(dir.rfind('/') + 1) + " at TP=" + std::to_string(world.size()) + " (" + path + ")";
  const auto outputs = shardit::io::SafetensorsFile::open(dir + "/outputs.safetensors");
  const auto lora_case = shardit::verify::read_lora_case(dir);
  auto model = load_transformer(dir, path);
  auto adapters = shardit::verify::load_lora_case(*model, lora_case);

  // Each rank reads exactly the bytes of its slices (the files are fp32, as the model).
  for (const auto& adapter : lora_case.adapters) {
    const auto stats = std::make_shared<shardit::io::ReadStats>();
    const auto spec = shardit::models::read_lora_spec(adapter.file, *model);
    auto probe_model = load_transformer(dir, path);
    shardit::parallel::LoraAdapters probe(*probe_model);
    probe.load("probe", spec, stats);
    const int tp_rank = model->parallel_config()->tp_rank();
    const auto file = shardit::io::SafetensorsFile::open(adapter.file);
    const int64_t expected = shardit::parallel::lora_bytes_on_rank(spec, *file, *model->resolved_plan(), tp_rank);
    EXPECT_EQ(static_cast<int64_t>(stats->bytes_read.load()), expected) << what << " " << adapter.file;
  }

  auto expect_sample = [&](const std::string& name) {
    const auto result = tensors_close(what + " " + name, run_case(*model, dir), outputs->read(name), kTol, kTol);
    EXPECT_TRUE(result);
    if (world.rank() == 0) std::cout << result.message() << "\n";
  };
  expect_sample("sample");
  if (outputs->contains("sample_scaled")) {
    adapters->set_scale(lora_case.lora_scale);
    expect_sample("sample_scaled");
    adapters->set_scale(1.0);
  }

  adapters->fuse(lora_case.lora_scale);
  const auto& plan = *model->resolved_plan();
  const int tp_rank = model->parallel_config()->tp_rank();
  for (const std::string& name : outputs->names()) {
    if (name.rfind("merged.", 0) != 0) continue;
    const std::string parameter = name.substr(7);
    auto* layer = dynamic_cast<shardit::nn::Linear*>(model->find_module(parameter.substr(0, parameter.size() - 7)));
    ASSERT_NE(layer, nullptr) << name;
    const at::Tensor expected = shardit::parallel::shard_tensor(outputs->read(name), plan.spec(parameter), tp_rank);
    EXPECT_TRUE(tensors_close(what + " " + name + " on rank " + std::to_string(tp_rank), layer->weight, expected,
                              kMergedTol, 0.0));
  }
  expect_sample("sample_fused");
}

void lora_worker() {
  shardit::dist::World::init();
  std::istringstream cases(env_or("SHARDIT_LORA_CASES"));
  std::string dir;
  while (cases >> dir) check_case(dir, env_or("SHARDIT_TP_PATH"));
}

void expect_lora_tp(int nproc) {
  std::string cases;
  for (const std::string& name : kCases) cases += golden_path(name) + " ";
  for (const std::string path : {"shard-on-load", "enable-parallelism"}) {
    EXPECT_EQ(run_ranks(nproc, {{"SHARDIT_LORA_CASES", cases}, {"SHARDIT_TP_PATH", path}}), 0)
        << "TP=" << nproc << " through " << path;
  }
}

// ---------------------------------------------------------------------------------------------
// Every Linear of the built-in tiny model (12 heads: TP=3), including the layers no golden case
// targets (embedders, modulation, time embedding, final norm and projection), with two random
// adapters (one with per-module alphas): TP=3 must give the single-rank output, unfused and fused.
// Tolerance as in test_tp_transformers.cpp: 1e-5 of max|reference| (fp32 sum order only).

std::string write_random_lora(TensorParallelModule& model, const std::string& path, int64_t rank, bool alphas,
                              uint64_t seed) {
  at::manual_seed(seed);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, module] : model.named_modules()) {
    const auto* layer = dynamic_cast<const shardit::nn::Linear*>(module);
    if (layer == nullptr) continue;
    const auto& options = layer->options();
    tensors.emplace_back("transformer." + name + ".lora_A.weight", at::randn({rank, options.in_features}) * 0.1);
    tensors.emplace_back("transformer." + name + ".lora_B.weight", at::randn({options.out_features, rank}) * 0.1);
    if (alphas) tensors.emplace_back("transformer." + name + ".alpha", at::scalar_tensor(static_cast<double>(rank) / 2));
  }
  shardit::io::save_safetensors(path, tensors);
  return path;
}

/// Loads the two adapters at weights 0.6 and -0.4 with runtime scale 0.8, runs, then fuses at 0.8.
std::pair<at::Tensor, at::Tensor> run_random_loras(const std::string& model_dir, const std::string& inputs_dir,
                                                   const std::string& path, const std::string& lora_dir) {
  auto model = load_transformer(model_dir, path);
  shardit::parallel::LoraAdapters adapters(*model);
  for (const std::string name : {"first", "second"}) {
    adapters.load(name, shardit::models::read_lora_spec(lora_dir + "/" + name + ".safetensors", *model));
  }
  adapters.set_adapters({"first", "second"}, {0.6, -0.4});
  adapters.set_scale(0.8);
  const at::Tensor unfused = run_case(*model, inputs_dir);
  adapters.fuse(0.8);
  return {unfused, run_case(*model, inputs_dir)};
}

TEST(TpLora, BuiltinEveryLinearAtTp3) {
  if (is_worker()) {
    shardit::dist::World::init();
    const auto [unfused, fused] = run_random_loras(env_or("SHARDIT_TP_MODEL"), env_or("SHARDIT_TP_INPUTS"),
                                                   env_or("SHARDIT_TP_PATH"), env_or("SHARDIT_LORA_DIR"));
    const auto reference = shardit::io::SafetensorsFile::open(env_or("SHARDIT_LORA_DIR") + "/reference.safetensors");
    for (const auto& [name, sample] : {std::pair{"unfused", unfused}, std::pair{"fused", fused}}) {
      const at::Tensor expected = reference->read(name);
      EXPECT_TRUE(tensors_close(std::string(name) + " at TP=3 (" + env_or("SHARDIT_TP_PATH") + ")", sample, expected,
                                1e-5 * expected.abs().max().item<double>(), 0.0));
    }
    return;
  }
  const auto paths = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  const std::string lora_dir = shardit::testing::make_temp_dir("lora-builtin");
  auto model = load_transformer(paths.pipeline);
  write_random_lora(*model, lora_dir + "/first.safetensors", 4, false, 1);
  write_random_lora(*model, lora_dir + "/second.safetensors", 6, true, 2);
  const at::Tensor base = run_case(*model, paths.inputs);
  const auto [unfused, fused] = run_random_loras(paths.pipeline, paths.inputs, "whole", lora_dir);
  // The adapters matter, and fusing gives the unfused result.
  EXPECT_GT((unfused - base).abs().max().item<double>(), 1e-2 * base.abs().max().item<double>());
  EXPECT_TRUE(tensors_close("fused vs unfused at TP=1", fused, unfused, 1e-5 * unfused.abs().max().item<double>(), 0.0));
  shardit::io::save_safetensors(lora_dir + "/reference.safetensors", {{"unfused", unfused}, {"fused", fused}});
  for (const std::string path : {"shard-on-load", "enable-parallelism"}) {
    EXPECT_EQ(run_ranks(3, {{"SHARDIT_TP_MODEL", paths.pipeline},
                            {"SHARDIT_TP_INPUTS", paths.inputs},
                            {"SHARDIT_TP_PATH", path},
                            {"SHARDIT_LORA_DIR", lora_dir}}),
              0)
        << "TP=3 through " << path;
  }
}

TEST(TpLora, GoldenCasesAtTp1) {
  if (is_worker()) return lora_worker();
  expect_lora_tp(1);
}

TEST(TpLora, GoldenCasesAtTp2) {
  if (is_worker()) return lora_worker();
  expect_lora_tp(2);
}

TEST(TpLora, GoldenCasesAtTp4) {
  if (is_worker()) return lora_worker();
  expect_lora_tp(4);
}

}  // namespace
}  // namespace test_tp_lora
