// `shardit schedule`: the sigmas, timesteps and transformer timestep input a pipeline's
// FlowMatchEulerDiscreteScheduler produces for a step count and image size, as JSON.
#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "shardit/io/model_folder.h"
#include "shardit/models/registry.h"
#include "shardit/models/vae/vae.h"
#include "shardit/pipelines/auto_pipeline.h"
#include "shardit/schedulers/scheduling_flow_match_euler_discrete.h"

namespace shardit::apps {

namespace {

namespace fs = std::filesystem;

struct ScheduleOptions {
  std::string model;
  int64_t steps = 0;
  int64_t height = 0;
  int64_t width = 0;
  std::string family;
};

/// The pipeline folder `model` is or lies in (a `scheduler/` component), or "".
std::string pipeline_root(const std::string& model) {
  const fs::path path = fs::path(model).lexically_normal();
  if (fs::exists(path / "model_index.json")) return path.string();
  const fs::path parent = (path.filename().empty() ? path.parent_path() : path).parent_path();
  if (!parent.empty() && fs::exists(parent / "model_index.json")) return parent.string();
  return "";
}

std::string json_floats(const at::Tensor& values) {
  const at::Tensor contiguous = values.to(at::kFloat).contiguous();
  const float* data = contiguous.data_ptr<float>();
  std::string out = "[";
  for (int64_t i = 0; i < contiguous.numel(); ++i) out += fmt::format("{}{}", i ? ", " : "", data[i]);
  return out + "]";
}

int run_schedule(const ScheduleOptions& options) {
  TORCH_CHECK(options.steps > 0, "schedule: --steps must be positive, got ", options.steps);
  TORCH_CHECK(options.height > 0 && options.width > 0, "schedule: --height and --width must be positive, got ",
              options.height, "x", options.width);
  const std::string root = pipeline_root(options.model);
  std::string family = options.family;
  if (family.empty()) {
    TORCH_CHECK(!root.empty(), "schedule: ", options.model,
                " is a bare scheduler folder, whose config does not say which pipeline uses it; pass --family "
                "flux1, flux2 or qwenimage");
    const io::ModelFolder folder = io::ModelFolder::open(root);
    const std::string class_name = folder.model_index().value("_class_name", "");
    const pipelines::PipelineClass* pipeline = pipelines::find_pipeline_class(class_name);
    TORCH_CHECK(pipeline != nullptr, root, "/model_index.json: pipeline class '", class_name,
                "' is not a FLUX.1, FLUX.2 or Qwen-Image pipeline; pass --family");
    family = pipeline->schedule_family;
  }
  TORCH_CHECK(family == "flux1" || family == "flux2" || family == "qwenimage", "schedule: --family '", family,
              "' is not one of flux1, flux2, qwenimage");

  // The pipelines' vae_scale_factor (8 without a VAE), from the pipeline's VAE config when there is one.
  int64_t vae_scale_factor = 8;
  if (!root.empty() && fs::exists(fs::path(root) / "vae")) {
    vae_scale_factor = models::create_vae(io::open_component(root, "vae"))->vae_scale_factor();
  }
  const int64_t patch = vae_scale_factor * 2;
  TORCH_CHECK(options.height >= patch && options.width >= patch, "schedule: ", options.height, "x", options.width,
              " is smaller than one latent token (", patch, "x", patch, " pixels)");
  const int64_t image_seq_len = (options.height / patch) * (options.width / patch);

  auto scheduler = schedulers::FlowMatchEulerDiscreteScheduler::from_pretrained(options.model);
  const auto& config = scheduler.config();
  const double mu = family == "flux2"
                        ? schedulers::compute_empirical_mu(image_seq_len, options.steps)
                        : schedulers::calculate_shift(image_seq_len, config.base_image_seq_len, config.max_image_seq_len,
                                                      config.base_shift, config.max_shift);
  scheduler.set_timesteps(options.steps, schedulers::pipeline_sigmas(options.steps), mu);
  const at::Tensor transformer_timestep = scheduler.timesteps() / 1000;

  fmt::print("{{\n  \"family\": \"{}\",\n  \"num_inference_steps\": {},\n  \"height\": {},\n  \"width\": {},\n"
             "  \"image_seq_len\": {},\n  \"mu\": {:.17g},\n  \"sigmas\": {},\n  \"timesteps\": {},\n"
             "  \"transformer_timestep\": {}\n}}\n",
             family, options.steps, options.height, options.width, image_seq_len, mu, json_floats(scheduler.sigmas()),
             json_floats(scheduler.timesteps()), json_floats(transformer_timestep));
  return 0;
}

}  // namespace

void register_schedule(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<ScheduleOptions>();
  CLI::App* command = app.add_subcommand(
      "schedule", "print a pipeline's scheduler schedule (mu, sigmas, timesteps, transformer timestep) as JSON");
  command->add_option("--model", options->model, "folder with scheduler_config.json, or a pipeline folder")
      ->required();
  // The bounds generate and serve apply (pipelines::check_request).
  command->add_option("--steps", options->steps, "num_inference_steps")
      ->required()
      ->check(integer_in(1, pipelines::kMaxInferenceSteps));
  command->add_option("--height", options->height, "image height in pixels")
      ->required()
      ->check(integer_in(1, pipelines::kMaxImageSide));
  command->add_option("--width", options->width, "image width in pixels")
      ->required()
      ->check(integer_in(1, pipelines::kMaxImageSide));
  command->add_option("--family", options->family,
                      "flux1, flux2 or qwenimage (how mu is computed); inferred from a pipeline folder");
  command->callback([&body, options] { body = [options] { return run_schedule(*options); }; });
}

}  // namespace shardit::apps
