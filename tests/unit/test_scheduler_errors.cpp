// FlowMatchEulerDiscreteScheduler: bad configs and calls fail with messages naming the key,
// the value and what to do.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

#include "shardit/schedulers/scheduling_flow_match_euler_discrete.h"
#include "support/test_support.h"

namespace shardit {
namespace test_scheduler_errors {
namespace {

using schedulers::FlowMatchEulerDiscreteScheduler;
using schedulers::FlowMatchEulerDiscreteSchedulerConfig;
using testing::error_of;

nlohmann::json flux_config() {
  return {{"_class_name", "FlowMatchEulerDiscreteScheduler"},
          {"shift", 3.0},
          {"use_dynamic_shifting", true},
          {"base_shift", 0.5},
          {"max_shift", 1.15}};
}

TEST(SchedulerErrors, RejectsUnknownTimeShiftType) {
  auto config = flux_config();
  config["time_shift_type"] = "cubic";
  const std::string message = error_of([&] { FlowMatchEulerDiscreteSchedulerConfig::from_json(config, "s.json"); });
  EXPECT_NE(message.find("s.json"), std::string::npos) << message;
  EXPECT_NE(message.find("cubic"), std::string::npos) << message;
}

TEST(SchedulerErrors, RejectsUnsupportedSigmaOptionsByName) {
  for (const char* key : {"use_karras_sigmas", "use_beta_sigmas", "stochastic_sampling"}) {
    auto config = flux_config();
    config[key] = true;
    const std::string message = error_of([&] { FlowMatchEulerDiscreteSchedulerConfig::from_json(config, "s.json"); });
    EXPECT_NE(message.find(key), std::string::npos) << message;
  }
}

TEST(SchedulerErrors, RejectsWrongValueTypeAndOtherClasses) {
  auto config = flux_config();
  config["shift"] = "three";
  std::string message = error_of([&] { FlowMatchEulerDiscreteSchedulerConfig::from_json(config, "s.json"); });
  EXPECT_NE(message.find("'shift'"), std::string::npos) << message;

  config = flux_config();
  config["_class_name"] = "EulerDiscreteScheduler";
  message = error_of([&] { FlowMatchEulerDiscreteSchedulerConfig::from_json(config, "s.json"); });
  EXPECT_NE(message.find("EulerDiscreteScheduler"), std::string::npos) << message;
}

// The config is read strictly: a value out of range, of the wrong type, or null where diffusers
// does not declare the key Optional is refused naming the file and the key.
TEST(SchedulerErrors, ConfigValuesOutOfRangeOrOfTheWrongTypeNameTheFileAndTheKey) {
  const std::vector<std::pair<const char*, nlohmann::json>> values = {
      {"num_train_timesteps", 0},     {"num_train_timesteps", 1000.5}, {"base_image_seq_len", -256},
      {"max_image_seq_len", "4096"},  {"max_shift", "1.15"},           {"base_shift", true},
      {"shift_terminal", "0.02"},     {"use_dynamic_shifting", 1},     {"invert_sigmas", nullptr},
      {"use_karras_sigmas", "false"}, {"stochastic_sampling", nullptr}, {"time_shift_type", 1}};
  for (const auto& [key, value] : values) {
    auto config = flux_config();
    config[key] = value;
    const std::string message = error_of([&] { FlowMatchEulerDiscreteSchedulerConfig::from_json(config, "s.json"); });
    EXPECT_NE(message.find(std::string("s.json: key '") + key + "'"), std::string::npos) << key << ": " << message;
  }
}

// Keys diffusers declares Optional may be null (as released configs write shift_terminal): the
// default.
TEST(SchedulerErrors, OptionalConfigKeysMayBeNull) {
  auto config = flux_config();
  for (const char* key : {"base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len", "shift_terminal",
                          "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas"}) {
    config[key] = nullptr;
  }
  const auto parsed = FlowMatchEulerDiscreteSchedulerConfig::from_json(config, "s.json");
  EXPECT_EQ(parsed.base_shift, 0.5);
  EXPECT_EQ(parsed.max_shift, 1.15);
  EXPECT_EQ(parsed.base_image_seq_len, 256);
  EXPECT_EQ(parsed.max_image_seq_len, 4096);
  EXPECT_FALSE(parsed.shift_terminal.has_value());
}

TEST(SchedulerErrors, BadCallsAreNamed) {
  FlowMatchEulerDiscreteScheduler scheduler(FlowMatchEulerDiscreteSchedulerConfig::from_json(flux_config(), "s.json"));
  EXPECT_NE(error_of([&] { scheduler.step(at::zeros({2}), 1000.0, at::zeros({2})); }).find("set_timesteps"),
            std::string::npos);
  EXPECT_NE(error_of([&] { scheduler.set_timesteps(0); }).find("num_inference_steps"), std::string::npos);
  EXPECT_NE(error_of([&] { scheduler.set_timesteps(4, schedulers::pipeline_sigmas(4)); }).find("mu"),
            std::string::npos);
  EXPECT_NE(error_of([&] { scheduler.set_timesteps(4, schedulers::pipeline_sigmas(3), 0.5); }).find("3 sigmas"),
            std::string::npos);
  scheduler.set_timesteps(4, schedulers::pipeline_sigmas(4), 0.5);
  EXPECT_NE(error_of([&] { scheduler.step(at::zeros({2}), 1.0, at::zeros({2})); }).find("not in the schedule"),
            std::string::npos);
  EXPECT_NE(error_of([&] { scheduler.step(at::zeros({2}), 1000.0, at::zeros({3})); }).find("shape"),
            std::string::npos);
}

TEST(Scheduler, WithoutDynamicShiftingUsesTheStaticShift) {
  // shift 1 and no dynamic shifting: the sigmas are the given ones (exactly, in float32).
  auto config = flux_config();
  config["use_dynamic_shifting"] = false;
  config["shift"] = 1.0;
  FlowMatchEulerDiscreteScheduler scheduler(FlowMatchEulerDiscreteSchedulerConfig::from_json(config, "s.json"));
  scheduler.set_timesteps(3, schedulers::pipeline_sigmas(3));
  const auto given = schedulers::pipeline_sigmas(3);
  const at::Tensor expected = at::tensor(
      {static_cast<float>(given[0]), static_cast<float>(given[1]), static_cast<float>(given[2]), 0.0f});
  EXPECT_TRUE(at::equal(scheduler.sigmas(), expected)) << scheduler.sigmas();
  // Without given sigmas, the schedule spans the training range: 1000 ... 1.
  scheduler.set_timesteps(2);
  EXPECT_FLOAT_EQ(scheduler.timesteps()[0].item<float>(), 1000.0f);
  EXPECT_FLOAT_EQ(scheduler.timesteps()[1].item<float>(), 1.0f);
}

TEST(Scheduler, LinspaceFollowsNumpy) {
  EXPECT_EQ(schedulers::linspace(1.0, 0.25, 4), (std::vector<double>{1.0, 0.75, 0.5, 0.25}));
  EXPECT_EQ(schedulers::linspace(1.0, 1.0, 1), (std::vector<double>{1.0}));
  EXPECT_TRUE(schedulers::linspace(0.0, 1.0, 0).empty());
}

}  // namespace
}  // namespace test_scheduler_errors
}  // namespace shardit
