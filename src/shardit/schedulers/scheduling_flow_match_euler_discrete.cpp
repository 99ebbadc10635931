#include "shardit/schedulers/scheduling_flow_match_euler_discrete.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <utility>

#include "shardit/io/model_folder.h"

namespace shardit::schedulers {

namespace {

/// diffusers' time shifts and terminal stretch over T = float (sigmas given by the pipeline,
/// numpy float32 arithmetic with Python scalars rounded to float32) or T = double (sigmas made
/// from the training timesteps, numpy float64).
template <class T>
std::vector<T> shift_schedule(const FlowMatchEulerDiscreteSchedulerConfig& config, std::vector<T> t,
                              std::optional<double> mu) {
  if (config.use_dynamic_shifting) {
    // time_shift(mu, sigma = 1.0, t); (1/t - 1) ** 1.0 is exact.
    const bool exponential = config.time_shift_type == "exponential";
    const T m = static_cast<T>(exponential ? std::exp(*mu) : *mu);
    for (T& value : t) {
      const T odds = T(1) / value - T(1);
      value = m / (m + odds);
    }
  } else {
    const T shift = static_cast<T>(config.shift);
    const T shift_minus_one = static_cast<T>(config.shift - 1.0);
    for (T& value : t) value = shift * value / (T(1) + shift_minus_one * value);
  }
  if (config.shift_terminal.has_value() && *config.shift_terminal != 0.0) {
    // stretch_shift_to_terminal: 1 - (1 - t) / scale_factor with scale_factor = (1 - t[-1]) /
    // (1 - shift_terminal); the scale factor is a numpy scalar divided by a Python float.
    const T last_one_minus = T(1) - t.back();
    const T scale_factor = static_cast<T>(static_cast<double>(last_one_minus) / (1.0 - *config.shift_terminal));
    for (T& value : t) value = T(1) - (T(1) - value) / scale_factor;
  }
  return t;
}

}  // namespace

FlowMatchEulerDiscreteSchedulerConfig FlowMatchEulerDiscreteSchedulerConfig::from_json(const nlohmann::json& config,
                                                                                     const std::string& source) {
  const io::ConfigReader reader(config, source);
  if (config.contains("_class_name") && config.at("_class_name").is_string()) {
    const std::string class_name = config.at("_class_name").get<std::string>();
    TORCH_CHECK(class_name == "FlowMatchEulerDiscreteScheduler", source, ": scheduler class '", class_name,
                "' is not supported; supported: FlowMatchEulerDiscreteScheduler");
  }
  const double any = io::kAnyFiniteNumber;
  FlowMatchEulerDiscreteSchedulerConfig out;
  out.num_train_timesteps = reader.integer("num_train_timesteps", out.num_train_timesteps, 1, io::kMaxConfigDim);
  out.shift = reader.number("shift", out.shift, -any, any);
  out.use_dynamic_shifting = reader.boolean("use_dynamic_shifting", out.use_dynamic_shifting);
  // diffusers declares these four Optional; null keeps the default, as the pipelines' calls do.
  out.base_shift = reader.optional_number("base_shift", -any, any).value_or(out.base_shift);
  out.max_shift = reader.optional_number("max_shift", -any, any).value_or(out.max_shift);
  out.base_image_seq_len =
      reader.optional_integer("base_image_seq_len", 1, io::kMaxConfigDim).value_or(out.base_image_seq_len);
  out.max_image_seq_len =
      reader.optional_integer("max_image_seq_len", 1, io::kMaxConfigDim).value_or(out.max_image_seq_len);
  out.invert_sigmas = reader.boolean("invert_sigmas", out.invert_sigmas);
  out.shift_terminal = reader.optional_number("shift_terminal", -any, any);
  out.time_shift_type = reader.string("time_shift_type", out.time_shift_type);

  TORCH_CHECK(out.time_shift_type == "exponential" || out.time_shift_type == "linear", source,
              ": time_shift_type must be \"exponential\" or \"linear\", got \"", out.time_shift_type, "\"");
  // shift 0 makes the first sigma 0 / 0; a negative one makes sigmas negative.
  TORCH_CHECK(out.shift > 0.0, source, ": shift must be positive, got ", out.shift);
  if (out.shift_terminal.has_value()) {
    TORCH_CHECK(*out.shift_terminal < 1.0, source, ": shift_terminal must be below 1, got ", *out.shift_terminal);
  }
  // Options this scheduler does not implement. The use_*_sigmas are Optional[bool] in diffusers
  // (null: off); stochastic_sampling is a bool.
  const std::pair<const char*, bool> unsupported[] = {
      {"use_karras_sigmas", reader.optional_boolean("use_karras_sigmas").value_or(false)},
      {"use_exponential_sigmas", reader.optional_boolean("use_exponential_sigmas").value_or(false)},
      {"use_beta_sigmas", reader.optional_boolean("use_beta_sigmas").value_or(false)},
      {"stochastic_sampling", reader.boolean("stochastic_sampling", false)}};
  for (const auto& [key, on] : unsupported) {
    TORCH_CHECK(!on, source, ": '", key,
                "': true is not supported by this FlowMatchEulerDiscreteScheduler (the FLUX and Qwen-Image "
                "pipelines use false); set it to false");
  }
  return out;
}

FlowMatchEulerDiscreteScheduler::FlowMatchEulerDiscreteScheduler(FlowMatchEulerDiscreteSchedulerConfig config)
    : config_(std::move(config)) {
  // __init__: timesteps N..1 in float32, sigmas = timesteps / N, shifted here only without
  // dynamic shifting (torch float32 with the shift as a float32 scalar).
  const int64_t n = config_.num_train_timesteps;
  const float train = static_cast<float>(n);
  auto sigma_of = [&](int64_t timestep) {
    float sigma = static_cast<float>(timestep) / train;
    if (!config_.use_dynamic_shifting) {
      const float shift = static_cast<float>(config_.shift);
      sigma = shift * sigma / (1.0f + static_cast<float>(config_.shift - 1.0) * sigma);
    }
    return sigma;
  };
  sigma_max_ = sigma_of(n);
  sigma_min_ = sigma_of(1);
}

FlowMatchEulerDiscreteScheduler FlowMatchEulerDiscreteScheduler::from_pretrained(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path file = fs::path(path) / "scheduler_config.json";
  if (!fs::exists(file) && fs::exists(fs::path(path) / "model_index.json")) {
    file = fs::path(path) / "scheduler" / "scheduler_config.json";
  }
  TORCH_CHECK(fs::exists(file), path, ": no scheduler_config.json here (nor scheduler/scheduler_config.json of a ",
              "pipeline folder)");
  return FlowMatchEulerDiscreteScheduler(
      FlowMatchEulerDiscreteSchedulerConfig::from_json(io::read_json_file(file.string()), file.string()));
}

void FlowMatchEulerDiscreteScheduler::set_timesteps(int64_t num_inference_steps,
                                                    const std::optional<std::vector<double>>& sigmas,
                                                    std::optional<double> mu) {
  TORCH_CHECK(num_inference_steps > 0, "FlowMatchEulerDiscreteScheduler: num_inference_steps must be positive, got ",
              num_inference_steps);
  TORCH_CHECK(!config_.use_dynamic_shifting || mu.has_value(),
              "FlowMatchEulerDiscreteScheduler: `mu` must be given when use_dynamic_shifting is true");
  if (config_.use_dynamic_shifting && config_.time_shift_type == "linear") {
    TORCH_CHECK(*mu > 0.0, "FlowMatchEulerDiscreteScheduler: the linear time shift needs mu > 0, got ", *mu);
  }
  std::vector<float> shifted;
  if (sigmas.has_value()) {
    TORCH_CHECK(static_cast<int64_t>(sigmas->size()) == num_inference_steps,
                "FlowMatchEulerDiscreteScheduler: got ", sigmas->size(), " sigmas for ", num_inference_steps,
                " inference steps; give one sigma per step");
    std::vector<float> t;
    t.reserve(sigmas->size());
    for (double s : *sigmas) {
      TORCH_CHECK(s > 0.0 && s <= 1.0, "FlowMatchEulerDiscreteScheduler: sigma ", s, " is outside (0, 1]");
      t.push_back(static_cast<float>(s));
    }
    shifted = shift_schedule<float>(config_, std::move(t), mu);
  } else {
    const double train = static_cast<double>(config_.num_train_timesteps);
    std::vector<double> t = linspace(sigma_max_ * train, sigma_min_ * train, num_inference_steps);
    for (double& value : t) value /= train;
    const std::vector<double> shifted64 = shift_schedule<double>(config_, std::move(t), mu);
    shifted.assign(shifted64.begin(), shifted64.end());
  }

  // Extreme configs (a huge mu from base_shift/max_shift, a shift overflowing float) can still
  // give sigmas that are not numbers; they would make every latent NaN and the image black.
  for (size_t i = 0; i < shifted.size(); ++i) {
    TORCH_CHECK(std::isfinite(shifted[i]) && shifted[i] >= 0.0f && shifted[i] <= 1.0f,
                "FlowMatchEulerDiscreteScheduler: sigma ", i, " of ", shifted.size(), " is ", shifted[i],
                " (shift ", config_.shift, mu.has_value() ? ", mu " + std::to_string(*mu) : std::string(),
                "), outside [0, 1]; check the scheduler config's shift, base_shift and max_shift");
  }
  at::Tensor s = at::tensor(shifted, at::TensorOptions().dtype(at::kFloat));  // [N]
  const auto train = static_cast<int64_t>(config_.num_train_timesteps);
  if (config_.invert_sigmas) {
    s = 1.0 - s;
    timesteps_ = s * train;
    sigmas_ = at::cat({s, at::ones({1}, s.options())});
  } else {
    timesteps_ = s * train;
    sigmas_ = at::cat({s, at::zeros({1}, s.options())});
  }
  num_inference_steps_ = num_inference_steps;
  step_index_ = -1;
  begin_index_ = -1;
}

void FlowMatchEulerDiscreteScheduler::set_begin_index(int64_t begin_index) {
  TORCH_CHECK(timesteps_.defined(), "FlowMatchEulerDiscreteScheduler: call set_timesteps before set_begin_index");
  TORCH_CHECK(begin_index >= 0 && begin_index < num_inference_steps_, "FlowMatchEulerDiscreteScheduler: begin index ",
              begin_index, " is outside [0, ", num_inference_steps_, ")");
  begin_index_ = begin_index;
}

int64_t FlowMatchEulerDiscreteScheduler::index_for_timestep(double timestep) const {
  TORCH_CHECK(timesteps_.defined(), "FlowMatchEulerDiscreteScheduler: call set_timesteps first");
  const float wanted = static_cast<float>(timestep);
  const float* values = timesteps_.data_ptr<float>();
  std::vector<int64_t> matches;
  for (int64_t i = 0; i < timesteps_.numel(); ++i) {
    if (values[i] == wanted) matches.push_back(i);
  }
  TORCH_CHECK(!matches.empty(), "FlowMatchEulerDiscreteScheduler: timestep ", timestep,
              " is not in the schedule; pass one of timesteps()");
  return matches.size() > 1 ? matches[1] : matches[0];
}

at::Tensor FlowMatchEulerDiscreteScheduler::step(const at::Tensor& model_output, double timestep,
                                                 const at::Tensor& sample) {
  TORCH_CHECK(timesteps_.defined(), "FlowMatchEulerDiscreteScheduler: call set_timesteps before step");
  TORCH_CHECK(model_output.sizes() == sample.sizes(), "FlowMatchEulerDiscreteScheduler.step: model_output has shape ",
              model_output.sizes(), ", sample has shape ", sample.sizes(), "; they must match");
  if (step_index_ < 0) step_index_ = begin_index_ >= 0 ? begin_index_ : index_for_timestep(timestep);
  TORCH_CHECK(step_index_ < num_inference_steps_, "FlowMatchEulerDiscreteScheduler: step ", step_index_,
              " is past the last of ", num_inference_steps_, " steps; call set_timesteps again");
  // dt = sigma_next - sigma as a float32 0-dim difference, as the reference.
  const at::Tensor dt = sigmas_[step_index_ + 1] - sigmas_[step_index_];
  const at::Tensor sample32 = sample.to(at::kFloat);
  at::Tensor prev_sample = sample32 + dt.to(sample32.device()) * model_output;
  ++step_index_;
  return prev_sample.to(model_output.scalar_type());
}

double calculate_shift(int64_t image_seq_len, int64_t base_seq_len, int64_t max_seq_len, double base_shift,
                       double max_shift) {
  TORCH_CHECK(max_seq_len != base_seq_len, "calculate_shift: base and max image sequence lengths are both ",
              base_seq_len, "; they must differ");
  const double m = (max_shift - base_shift) / static_cast<double>(max_seq_len - base_seq_len);
  const double b = base_shift - m * static_cast<double>(base_seq_len);
  return static_cast<double>(image_seq_len) * m + b;
}

double compute_empirical_mu(int64_t image_seq_len, int64_t num_steps) {
  const double a1 = 8.73809524e-05, b1 = 1.89833333;
  const double a2 = 0.00016927, b2 = 0.45666666;
  const double seq = static_cast<double>(image_seq_len);
  if (image_seq_len > 4300) return a2 * seq + b2;
  const double m_200 = a2 * seq + b2;
  const double m_10 = a1 * seq + b1;
  const double a = (m_200 - m_10) / 190.0;
  const double b = m_200 - 200.0 * a;
  return a * static_cast<double>(num_steps) + b;
}

std::vector<double> linspace(double start, double stop, int64_t num) {
  TORCH_CHECK(num >= 0, "linspace: num must be non-negative, got ", num);
  std::vector<double> out(static_cast<size_t>(num));
  if (num == 0) return out;
  const int64_t div = num - 1;
  const double delta = stop - start;
  const double step = div > 0 ? delta / static_cast<double>(div) : 0.0;
  for (int64_t i = 0; i < num; ++i) out[i] = static_cast<double>(i) * step + start;
  if (num > 1) out.back() = stop;
  return out;
}

std::vector<double> pipeline_sigmas(int64_t num_inference_steps) {
  TORCH_CHECK(num_inference_steps > 0, "num_inference_steps must be positive, got ", num_inference_steps);
  return linspace(1.0, 1.0 / static_cast<double>(num_inference_steps), num_inference_steps);
}

}  // namespace shardit::schedulers
