// FlowMatchEulerDiscreteScheduler against diffusers' golden schedules (scheduler/): mu from the
// pipelines' helpers, then sigmas, timesteps, the transformer's timestep input and step()
// results for every case. Tolerance 1e-6 absolute (golden README), applied relative to the
// magnitude for the timesteps (values up to 1000, where one float32 ulp is 6e-5).
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <string>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/schedulers/scheduling_flow_match_euler_discrete.h"
#include "support/test_support.h"

namespace shardit {
namespace test_parity_scheduler {
namespace {

using schedulers::FlowMatchEulerDiscreteScheduler;
using testing::golden_path;
using testing::tensors_close;

constexpr double kTol = 1e-6;

void expect_close(const std::string& what, const at::Tensor& actual, const at::Tensor& expected, double atol,
                  double rtol) {
  const auto result = tensors_close(what, actual, expected, atol, rtol);
  EXPECT_TRUE(result);
  std::cout << "  " << result.message() << "\n";
}

TEST(SchedulerParity, EveryCaseMatchesDiffusers) {
  const nlohmann::json cases = io::read_json_file(golden_path("scheduler/cases.json"));
  const auto tensors = io::SafetensorsFile::open(golden_path("scheduler/scheduler.safetensors"));
  int checked = 0;
  for (const auto& entry : cases.at("cases")) {
    const std::string name = entry.at("name");
    const std::string family = entry.at("family");
    const int64_t steps = entry.at("num_inference_steps");
    const int64_t seq = entry.at("image_seq_len");
    EXPECT_EQ(seq, (entry.at("height").get<int64_t>() / 16) * (entry.at("width").get<int64_t>() / 16)) << name;
    SCOPED_TRACE(name + " (" + family + ")");

    auto scheduler = FlowMatchEulerDiscreteScheduler::from_pretrained(
        golden_path("scheduler/" + family + "_scheduler_config"));
    const auto& config = scheduler.config();
    const double mu = entry.at("mu_function") == "compute_empirical_mu"
                          ? schedulers::compute_empirical_mu(seq, steps)
                          : schedulers::calculate_shift(seq, config.base_image_seq_len, config.max_image_seq_len,
                                                        config.base_shift, config.max_shift);
    const double expected_mu = entry.at("mu");
    EXPECT_NEAR(mu, expected_mu, 1e-12 * std::abs(expected_mu)) << name << ": mu";
    std::cout << name << ": mu " << mu << " (reference " << expected_mu << ")\n";

    scheduler.set_timesteps(steps, schedulers::pipeline_sigmas(steps), mu);
    expect_close(name + ".sigmas", scheduler.sigmas(), tensors->read(name + ".sigmas"), kTol, 0.0);
    expect_close(name + ".timesteps", scheduler.timesteps(), tensors->read(name + ".timesteps"), 0.0, kTol);
    expect_close(name + ".transformer_timestep", scheduler.timesteps() / 1000,
                 tensors->read(name + ".transformer_timestep"), kTol, 0.0);

    const at::Tensor sample = tensors->read(name + ".sample");
    const at::Tensor model_output = tensors->read(name + ".model_output");
    for (const auto& k : entry.at("step_indices")) {
      const int64_t index = k.get<int64_t>();
      scheduler.set_timesteps(steps, schedulers::pipeline_sigmas(steps), mu);
      scheduler.set_begin_index(index);
      const double timestep = scheduler.timesteps()[index].item<float>();
      const at::Tensor prev = scheduler.step(model_output, timestep, sample);
      EXPECT_EQ(scheduler.step_index(), index + 1);
      const std::string key = name + ".prev_sample.step" + std::to_string(index);
      expect_close(key, prev, tensors->read(key), kTol, 0.0);

      // Locating the step from the timestep gives the same result as the begin index.
      scheduler.set_timesteps(steps, schedulers::pipeline_sigmas(steps), mu);
      EXPECT_EQ(scheduler.index_for_timestep(timestep), index);
    }
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(cases.at("cases").size()));
  EXPECT_GE(checked, 12);
}

TEST(SchedulerParity, StepsAdvanceAlongTheSchedule) {
  // A full loop from the first timestep: each step uses the next sigma pair.
  auto scheduler = FlowMatchEulerDiscreteScheduler::from_pretrained(golden_path("scheduler/flux1_dev_scheduler_config"));
  const int64_t steps = 4;
  scheduler.set_timesteps(steps, schedulers::pipeline_sigmas(steps), schedulers::calculate_shift(256));
  at::Tensor sample = at::zeros({1, 2});
  const at::Tensor velocity = at::ones({1, 2});
  for (int64_t i = 0; i < steps; ++i) {
    sample = scheduler.step(velocity, scheduler.timesteps()[i].item<float>(), sample);
  }
  // sum of (sigma_{i+1} - sigma_i) = sigma_N - sigma_0 = 0 - 1.
  EXPECT_NEAR(sample[0][0].item<float>(), -1.0, 1e-6);
}

/// The `shardit schedule` JSON for `arguments`.
nlohmann::json run_schedule(const std::string& arguments) {
  std::string output;
  const int status = testing::run_command(testing::cli_path() + " schedule " + arguments + " 2>&1", &output);
  EXPECT_EQ(status, 0) << output;
  return status == 0 ? nlohmann::json::parse(output) : nlohmann::json();
}

at::Tensor floats(const nlohmann::json& values) { return at::tensor(values.get<std::vector<float>>()); }

TEST(ScheduleCommand, PrintsTheGoldenSchedule) {
  // case09: Qwen-Image, 28 steps at 1024x1024, from the bare scheduler folder with --family.
  const auto tensors = io::SafetensorsFile::open(golden_path("scheduler/scheduler.safetensors"));
  const nlohmann::json out = run_schedule("--model " + golden_path("scheduler/qwenimage_scheduler_config") +
                                          " --steps 28 --height 1024 --width 1024 --family qwenimage");
  ASSERT_FALSE(out.is_null());
  EXPECT_EQ(out.at("image_seq_len"), 4096);
  EXPECT_DOUBLE_EQ(out.at("mu").get<double>(), 0.6935483870967742);
  EXPECT_TRUE(tensors_close("sigmas", floats(out.at("sigmas")), tensors->read("case09.sigmas"), 0.0, 0.0));
  EXPECT_TRUE(tensors_close("timesteps", floats(out.at("timesteps")), tensors->read("case09.timesteps"), 0.0, 0.0));
  EXPECT_TRUE(tensors_close("transformer_timestep", floats(out.at("transformer_timestep")),
                            tensors->read("case09.transformer_timestep"), 0.0, 0.0));
}

TEST(ScheduleCommand, BareSchedulerFolderNeedsTheFamily) {
  std::string output;
  EXPECT_NE(testing::run_command(testing::cli_path() + " schedule --model " +
                                     golden_path("scheduler/flux2_scheduler_config") +
                                     " --steps 4 --height 256 --width 256 2>&1",
                                 &output),
            0);
  EXPECT_NE(output.find("--family"), std::string::npos) << output;
}

class ScheduleCommandPipeline : public ::testing::TestWithParam<std::string> {};

TEST_P(ScheduleCommandPipeline, MatchesThePipelineRun) {
  // The family and the VAE scale factor come from the pipeline folder; the pipeline's own
  // schedule and the timestep it fed the transformer at each step.
  const std::string dir = golden_path(GetParam());
  const nlohmann::json call = io::read_json_file(dir + "/case.json").at("call");
  const nlohmann::json derived = io::read_json_file(dir + "/case.json").at("derived");
  const int64_t steps = call.at("num_inference_steps");
  const nlohmann::json out = run_schedule("--model " + dir + " --steps " + std::to_string(steps) + " --height " +
                                          std::to_string(call.at("height").get<int64_t>()) + " --width " +
                                          std::to_string(call.at("width").get<int64_t>()));
  ASSERT_FALSE(out.is_null());
  EXPECT_EQ(out.at("image_seq_len"), derived.at("image_seq_len"));
  EXPECT_NEAR(out.at("mu").get<double>(), derived.at("mu").get<double>(), 1e-15);
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  EXPECT_TRUE(tensors_close(GetParam() + " sigmas", floats(out.at("sigmas")), outputs->read("scheduler.sigmas"), 0, 0));
  EXPECT_TRUE(
      tensors_close(GetParam() + " timesteps", floats(out.at("timesteps")), outputs->read("scheduler.timesteps"), 0, 0));
  const at::Tensor transformer_timestep = floats(out.at("transformer_timestep"));
  for (int64_t i = 0; i < steps; ++i) {
    const at::Tensor fed = outputs->read("step" + std::to_string(i) + ".timestep");
    EXPECT_TRUE(tensors_close(GetParam() + " step" + std::to_string(i) + ".timestep",
                              transformer_timestep[i].expand(fed.sizes()), fed, 0, 0));
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, ScheduleCommandPipeline,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_qwenimage"));

}  // namespace
}  // namespace test_parity_scheduler
}  // namespace shardit
