// Step caches (models/step_cache.h) on their own: the configs as users write them (and every
// refusal, named), TaylorSeer's schedule against the decisions diffusers recorded in the golden
// cases, its prediction arithmetic, and First-Block Cache's decision and cached output; and
// `shardit generate --cache` at one rank on the golden cache cases (every per-step decision, the
// ratios and the image as diffusers' hooks gave them; the same cases on meshes of 4 ranks:
// tests/dist/test_step_cache_meshes.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/models/step_cache.h"
#include "support/pipeline_case.h"
#include "support/step_cache_case.h"
#include "support/test_support.h"

namespace test_step_cache {
namespace {

using shardit::models::FirstBlockCacheConfig;
using shardit::models::StepCache;
using shardit::models::StepCacheConfig;
using shardit::models::TaylorSeerCacheConfig;
using shardit::testing::CacheGolden;
using shardit::testing::expect_cache_case_matches;
using shardit::testing::golden_contexts;
using shardit::testing::read_cache_golden;

void expect_refused(const std::string& spec, const std::string& fragment) {
  try {
    StepCacheConfig::parse(spec);
    ADD_FAILURE() << spec << " was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << spec << ": " << e.what();
  }
}

TEST(StepCacheConfig, ParsesDiffusersNamesAndPrintsThemBack) {
  const StepCacheConfig fbc = StepCacheConfig::parse("first_block_cache:threshold=0.12");
  ASSERT_TRUE(std::holds_alternative<FirstBlockCacheConfig>(fbc.method));
  EXPECT_DOUBLE_EQ(std::get<FirstBlockCacheConfig>(fbc.method).threshold, 0.12);
  EXPECT_EQ(fbc.to_string(), "first_block_cache:threshold=0.12");
  EXPECT_DOUBLE_EQ(std::get<FirstBlockCacheConfig>(StepCacheConfig::parse("first_block_cache").method).threshold, 0.05);

  const StepCacheConfig ts = StepCacheConfig::parse(
      "taylorseer_lite:cache_interval=4,disable_cache_before_step=1,max_order=2,disable_cache_after_step=9,"
      "taylor_factors_dtype=bfloat16");
  const auto& t = std::get<TaylorSeerCacheConfig>(ts.method);
  EXPECT_EQ(t.cache_interval, 4);
  EXPECT_EQ(t.disable_cache_before_step, 1);
  EXPECT_EQ(t.max_order, 2);
  EXPECT_EQ(t.disable_cache_after_step, 9);
  EXPECT_EQ(t.taylor_factors_dtype, at::kBFloat16);
  // Printed back and read again: the same config.
  EXPECT_EQ(StepCacheConfig::parse(ts.to_string()).to_json(), ts.to_json());
  EXPECT_EQ(StepCacheConfig::from_json(ts.to_json()).to_string(), ts.to_string());
  // diffusers' defaults, float32 factors.
  const auto defaults = std::get<TaylorSeerCacheConfig>(StepCacheConfig::parse("taylorseer_lite").method);
  EXPECT_EQ(defaults.cache_interval, 5);
  EXPECT_EQ(defaults.disable_cache_before_step, 3);
  EXPECT_FALSE(defaults.disable_cache_after_step.has_value());
  EXPECT_EQ(defaults.taylor_factors_dtype, at::kFloat);
}

TEST(StepCacheConfig, RefusesWhatItCannotTakeNamingTheKey) {
  expect_refused("teacache:threshold=0.1", "kinds are first_block_cache");
  expect_refused("first_block_cache:treshold=0.1", "unknown key \"treshold\"");
  expect_refused("first_block_cache:threshold=nan", "threshold");
  expect_refused("first_block_cache:threshold=-0.1", "threshold");
  expect_refused("first_block_cache:threshold=1e400", "threshold");
  expect_refused("first_block_cache:threshold", "is not key=value");
  expect_refused("first_block_cache:threshold=0.1,threshold=0.2", "given twice");
  expect_refused("taylorseer_lite:cache_interval=0", "cache_interval");
  expect_refused("taylorseer_lite:cache_interval=2.5", "whole number");
  expect_refused("taylorseer_lite:max_order=9", "max_order");
  expect_refused("taylorseer_lite:disable_cache_before_step=-1", "disable_cache_before_step");
  expect_refused("taylorseer_lite:cache_interval=18446744073709551615", "cache_interval");
  expect_refused("taylorseer_lite:disable_cache_before_step=0,cache_interval=5", "predict the first step");
  expect_refused("taylorseer_lite:taylor_factors_dtype=int8", "taylor_factors_dtype");
  // Every forward computes: before 0 is then harmless.
  EXPECT_NO_THROW(StepCacheConfig::parse("taylorseer_lite:disable_cache_before_step=0,cache_interval=1"));
}

/// Runs `steps` forwards of a context through a TaylorSeer cache, the output of a computed
/// forward s being `output(s)`; returns the outputs (computed or predicted) and the decisions.
template <class Output>
std::pair<std::vector<at::Tensor>, std::vector<bool>> run_taylorseer(StepCache& cache, int64_t steps, Output output) {
  std::vector<at::Tensor> outputs;
  for (int64_t s = 0; s < steps; ++s) {
    std::optional<at::Tensor> predicted = cache.begin_forward(1, 3);
    if (predicted) {
      outputs.push_back(*predicted);
      continue;
    }
    const at::Tensor computed = output(s);
    cache.computed_output(computed);
    outputs.push_back(computed);
  }
  return {outputs, cache.records().at(0).computed};
}

TEST(StepCacheTaylorSeer, ScheduleIsDiffusersOnTheGoldenCases) {
  int cases = 0;
  for (const char* name : {"cache_flux1", "cache_qwenimage"}) {
    const nlohmann::json golden = shardit::io::read_json_file(shardit::testing::golden_path(name) + "/case.json");
    const int64_t contexts = golden.at("cfg_contexts").get<int64_t>();
    for (const nlohmann::json& c : golden.at("cases")) {
      if (c.at("config").at("kind") != "taylorseer_lite") continue;
      StepCache cache(StepCacheConfig::from_json(c.at("config")));
      const auto expected = c.at("full_stack_calls_per_step").get<std::vector<int64_t>>();
      const auto [outputs, computed] = run_taylorseer(cache, static_cast<int64_t>(expected.size()), [](int64_t s) {
        return at::full({1, 3, 2}, static_cast<float>(s));
      });
      ASSERT_EQ(computed.size(), expected.size());
      for (size_t s = 0; s < expected.size(); ++s) {
        EXPECT_EQ(computed[s] ? contexts : 0, expected[s]) << name << " " << c.at("name") << " step " << s;
      }
      ++cases;
    }
  }
  EXPECT_EQ(cases, 4);
}

TEST(StepCacheTaylorSeer, PredictsFromDividedDifferences) {
  // F(s) = 2 + 3 s + 0.5 s^2 per element. Order 2 from computed steps 0, 1, 2 (then every 4th):
  // F0 = F(2) = 10, F1 = F(2) - F(1) = 4.5, F2 = (F1 - F1_prev) / 1 = 4.5 - 3.5 = 1: the prediction
  // at offset k is 10 + 4.5 k + k^2 / 2 (backward differences: not F(2 + k)).
  StepCache cache(StepCacheConfig::parse("taylorseer_lite:cache_interval=4,disable_cache_before_step=3,max_order=2"));
  const auto f = [](int64_t s) {
    const double x = static_cast<double>(s);
    return at::full({1, 3, 2}, static_cast<float>(2 + 3 * x + 0.5 * x * x));
  };
  const auto [outputs, computed] = run_taylorseer(cache, 7, f);
  EXPECT_EQ(computed, (std::vector<bool>{true, true, true, false, true, false, false}));
  EXPECT_TRUE(at::allclose(outputs[3], at::full({1, 3, 2}, 15.0f)));
  EXPECT_TRUE(at::equal(outputs[4], f(4)));
  // After step 4: F1 = (F(4) - F(2)) / 2 = 6, F2 = (6 - 4.5) / 2 = 0.75; step 5 (k=1): F(4) + 6 + 0.375.
  EXPECT_TRUE(at::allclose(outputs[5], f(4) + 6 + 0.375));
  EXPECT_TRUE(at::allclose(outputs[6], f(4) + 12 + 0.75 * 2));
  // Predictions keep the output's dtype and the cache holds three [1, 3, 2] float32 factors.
  EXPECT_EQ(outputs[5].scalar_type(), at::kFloat);
  EXPECT_EQ(cache.state_bytes(), 3 * 6 * 4);
}

TEST(StepCacheTaylorSeer, ContextsCountTheirOwnSteps) {
  StepCache cache(StepCacheConfig::parse("taylorseer_lite:cache_interval=2,disable_cache_before_step=1"));
  for (int64_t s = 0; s < 4; ++s) {
    for (const char* context : {"cond", "uncond"}) {
      cache.set_context(context);
      if (!cache.begin_forward(1, 1)) cache.computed_output(at::ones({1, 1, 1}));
    }
  }
  const auto records = cache.records();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].context, "cond");
  EXPECT_EQ(records[1].context, "uncond");
  // s = 0 warm-up, then (s - 2) % 2 == 0: s = 2.
  EXPECT_EQ(records[0].computed, (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(records[1].computed, records[0].computed);
  // A new generation forgets everything.
  cache.reset();
  EXPECT_TRUE(cache.records().empty());
  EXPECT_EQ(cache.state_bytes(), 0);
}

TEST(StepCacheFirstBlock, SkipsBelowTheThresholdAndAddsTheTailResidual) {
  StepCache cache(StepCacheConfig::parse("first_block_cache:threshold=0.2"));
  const auto forward = [&cache](const at::Tensor& residual, at::Tensor head_output, const at::Tensor& stack_output) {
    cache.begin_forward(1, 4);
    at::Tensor sums = cache.head_residual_sums(residual);
    if (sums.defined()) sums = sums.sum(-1);  // one rank: the whole sequence is here
    const bool runs = cache.head_decides(sums, residual, head_output);
    if (runs) cache.end_of_stack(stack_output);
    return std::make_pair(runs, head_output);
  };
  const at::Tensor r0 = at::ones({1, 4, 2});
  const at::Tensor head0 = at::full({1, 4, 2}, 10.0);
  // The first forward always runs the stack; its tail residual is 5.
  EXPECT_TRUE(forward(r0, head0, head0 + 5).first);
  // |r - r_prev| / |r_prev| = 0.1 <= 0.2: skipped, the head output plus the tail residual.
  const auto [runs1, out1] = forward(r0 * 1.1, at::full({1, 4, 2}, 20.0), at::Tensor());
  EXPECT_FALSE(runs1);
  EXPECT_TRUE(at::equal(out1, at::full({1, 4, 2}, 25.0)));
  // Compared with the last COMPUTED forward's r (not the skipped one's): 0.3 > 0.2 runs.
  EXPECT_TRUE(forward(r0 * 1.3, head0, head0 + 7).first);
  // 0.15 against the new r_prev: skipped again.
  EXPECT_FALSE(forward(r0 * 1.3 * 1.15, head0, at::Tensor()).first);
  const auto record = cache.records().at(0);
  EXPECT_EQ(record.computed, (std::vector<bool>{true, false, true, false}));
  EXPECT_TRUE(std::isnan(record.ratios[0]));
  EXPECT_NEAR(record.ratios[1], 0.1, 1e-6);
  EXPECT_NEAR(record.ratios[2], 0.3, 1e-6);
  EXPECT_NEAR(record.ratios[3], 0.15, 1e-6);
  // Kept: r_prev and the tail residual, [1, 4, 2] float32 each.
  EXPECT_EQ(cache.state_bytes(), 2 * 8 * 4);
  // Threshold 0: any change runs the stack (only an identical residual, ratio 0, would skip).
  StepCache never(StepCacheConfig::parse("first_block_cache:threshold=0"));
  never.begin_forward(1, 4);
  at::Tensor out = head0;
  EXPECT_TRUE(never.head_decides(at::Tensor(), r0, out));
  never.end_of_stack(head0 + 1);
  never.begin_forward(1, 4);
  EXPECT_TRUE(never.head_decides(never.head_residual_sums(r0 * 1.0001).sum(-1), r0 * 1.0001, out));
}

TEST(StepCacheFirstBlock, OtherSizesInOneGenerationAreRefused) {
  StepCache cache(StepCacheConfig::parse("first_block_cache:threshold=0.2"));
  cache.begin_forward(1, 4);
  at::Tensor out = at::zeros({1, 4, 2});
  cache.head_decides(at::Tensor(), at::ones({1, 4, 2}), out);
  cache.end_of_stack(out);
  cache.begin_forward(1, 5);
  try {
    cache.head_residual_sums(at::ones({1, 5, 2}));
    ADD_FAILURE() << "a residual of another shape was compared";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("reset it between generations"), std::string::npos) << e.what();
  }
}

// `shardit generate --cache` at one rank: each golden cache case's per-step decisions, ratios and
// image as diffusers' hooks recorded them, and the summary it prints.
class StepCacheGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(StepCacheGolden, GenerateCliMatchesDiffusersHooksAtOneRank) {
  const CacheGolden golden = read_cache_golden(GetParam());
  int cases = 0;
  for (const nlohmann::json& golden_case : golden.cases) {
    const std::string spec = StepCacheConfig::from_json(golden_case.at("config")).to_string();
    const auto run = shardit::testing::run_generate_cli(golden.pipeline, "", "--cache " + spec);
    const std::string what = GetParam() + " " + golden_case.at("name").get<std::string>() + " (CLI, TP=1)";
    expect_cache_case_matches(golden, golden_case, golden_contexts(golden), run.cache_computed, run.cache_ratio,
                              run.image, what);
    // The stderr summary says what ran.
    EXPECT_NE(run.output.find("step cache " + spec + ": the whole stack ran in"), std::string::npos) << run.output;
    ++cases;
  }
  EXPECT_EQ(cases, 5);
}

INSTANTIATE_TEST_SUITE_P(Golden, StepCacheGolden, ::testing::Values("cache_flux1", "cache_qwenimage"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace test_step_cache
