#pragma once
// diffusers' FlowMatchEulerDiscreteScheduler (scheduling_flow_match_euler_discrete.py) as the
// FLUX.1, FLUX.2 and Qwen-Image pipelines configure it, plus the pipelines' `mu` helpers.
//
// The schedule is computed with the reference's number types: sigmas handed in by a pipeline are
// cast to float32 and shifted in float32 (numpy float32 arithmetic, Python scalars rounded to
// float32); a schedule made from the training timesteps is shifted in float64 and cast to
// float32 at the end. Timesteps are sigmas * num_train_timesteps in float32.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardit::schedulers {

/// scheduler_config.json of a FlowMatchEulerDiscreteScheduler (same keys, diffusers' defaults).
struct FlowMatchEulerDiscreteSchedulerConfig {
  int64_t num_train_timesteps = 1000;
  double shift = 1.0;
  bool use_dynamic_shifting = false;
  double base_shift = 0.5;
  double max_shift = 1.15;
  int64_t base_image_seq_len = 256;
  int64_t max_image_seq_len = 4096;
  bool invert_sigmas = false;
  /// The value the shifted schedule is stretched to end at; nullopt (or 0): no stretching.
  std::optional<double> shift_terminal;
  /// "exponential" or "linear".
  std::string time_shift_type = "exponential";

  /// Parses a scheduler_config.json object; `source` names the file in errors. Options this
  /// scheduler does not implement (Karras, exponential or beta sigmas, stochastic sampling) are
  /// rejected by name.
  static FlowMatchEulerDiscreteSchedulerConfig from_json(const nlohmann::json& config, const std::string& source);
};

/// Euler steps along a flow-matching (rectified flow) schedule.
class FlowMatchEulerDiscreteScheduler {
 public:
  explicit FlowMatchEulerDiscreteScheduler(FlowMatchEulerDiscreteSchedulerConfig config);
  /// From a folder holding scheduler_config.json, or a pipeline folder with a `scheduler/`
  /// component (diffusers' from_pretrained).
  static FlowMatchEulerDiscreteScheduler from_pretrained(const std::string& path);

  const FlowMatchEulerDiscreteSchedulerConfig& config() const { return config_; }

  /// Sets the schedule for `num_inference_steps` steps. `sigmas` (optional, the pipelines pass
  /// np.linspace(1, 1/N, N)) must have num_inference_steps entries; `mu` is required with
  /// dynamic shifting. Resets the step index.
  void set_timesteps(int64_t num_inference_steps, const std::optional<std::vector<double>>& sigmas = std::nullopt,
                     std::optional<double> mu = std::nullopt);

  /// float32 [N + 1]: the schedule with a trailing 0 (1 with invert_sigmas).
  const at::Tensor& sigmas() const { return sigmas_; }
  /// float32 [N]: sigmas[:-1] * num_train_timesteps.
  const at::Tensor& timesteps() const { return timesteps_; }
  int64_t num_inference_steps() const { return num_inference_steps_; }

  /// Where the next step() starts (diffusers' set_begin_index): the pipelines set 0.
  void set_begin_index(int64_t begin_index);
  /// The index of the next step, or -1 before the first step.
  int64_t step_index() const { return step_index_; }
  /// The index of `timestep` in timesteps() (the second match when it occurs twice, as diffusers).
  int64_t index_for_timestep(double timestep) const;

  /// One Euler step: sample + (sigma_next - sigma) * model_output, computed in float32 and
  /// returned in model_output's dtype. `timestep` is one of timesteps(); it locates the step on
  /// the first call unless a begin index was set. Advances the step index.
  at::Tensor step(const at::Tensor& model_output, double timestep, const at::Tensor& sample);

 private:
  FlowMatchEulerDiscreteSchedulerConfig config_;
  double sigma_min_ = 0.0;
  double sigma_max_ = 1.0;
  at::Tensor sigmas_;
  at::Tensor timesteps_;
  int64_t num_inference_steps_ = 0;
  int64_t step_index_ = -1;
  int64_t begin_index_ = -1;
};

/// The FLUX.1 / Qwen-Image pipelines' `calculate_shift`: mu linear in the image token count,
/// base_shift at base_seq_len and max_shift at max_seq_len.
double calculate_shift(int64_t image_seq_len, int64_t base_seq_len = 256, int64_t max_seq_len = 4096,
                       double base_shift = 0.5, double max_shift = 1.15);

/// The FLUX.2 pipelines' `compute_empirical_mu` from the image token count and the step count.
double compute_empirical_mu(int64_t image_seq_len, int64_t num_steps);

/// numpy.linspace(start, stop, num) in float64, with numpy's arithmetic (start + i * step, the
/// last entry exactly stop).
std::vector<double> linspace(double start, double stop, int64_t num);

/// The sigmas the pipelines pass: np.linspace(1.0, 1 / num_inference_steps, num_inference_steps).
std::vector<double> pipeline_sigmas(int64_t num_inference_steps);

}  // namespace shardit::schedulers
