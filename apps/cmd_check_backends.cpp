// `shardit check-backends`: one forward of a transformer per attention backend, each compared
// with the `math` backend's sample (max and mean |diff|, pass or fail), with the backend that
// actually ran each attention call counted; a backend that cannot take the model's calls (amx in
// f32) is listed as n/a with its reason. Exits 1 when any backend fails.
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <string>

#include "apps/commands.h"
#include "shardit/core/dtype.h"
#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/models/registry.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/verify/transformer_case.h"

namespace shardit::apps {

namespace {

struct CheckBackendsOptions {
  std::string model;
  std::string inputs;  ///< "": the model folder, when it holds inputs.safetensors
  std::string dtype = "f32";
  /// |diff| <= atol + rtol * |math| elementwise. The fp32 default is the golden tolerance of the
  /// transformers; bf16 rounds scores and probabilities at different points per backend.
  double atol = -1;
  double rtol = -1;
};

std::string counts_text(const std::map<std::string, int64_t>& counts) {
  std::string out;
  for (const auto& [name, n] : counts) out += fmt::format("{}{} x{}", out.empty() ? "" : ", ", name, n);
  return out.empty() ? "none" : out;
}

int check_backends(const CheckBackendsOptions& given) {
  dist::World& world = dist::World::get();
  CheckBackendsOptions options = given;
  if (options.model.empty()) {
    TORCH_CHECK(options.inputs.empty(), "check-backends: --inputs without --model; give --model (and --inputs "
                                        "unless the model folder holds inputs.safetensors)");
    const auto builtin = models::write_builtin_model(models::default_builtin_model_root());
    options.model = builtin.pipeline;
    options.inputs = builtin.inputs;
    if (world.rank() == 0) fmt::print("(no --model given: checking on the built-in tiny model)\n");
  }
  if (options.inputs.empty()) {
    TORCH_CHECK(std::filesystem::exists(std::filesystem::path(options.model) / "inputs.safetensors"),
                "check-backends: ", options.model, " holds no inputs.safetensors; give --inputs (a case folder "
                "with inputs.safetensors, or the file)");
    options.inputs = options.model;
  }
  const at::ScalarType dtype = parse_compute_dtype(options.dtype);
  const bool bf16 = dtype != at::kFloat;
  const double atol = options.atol >= 0 ? options.atol : (bf16 ? 2e-2 : 1e-4);
  const double rtol = options.rtol >= 0 ? options.rtol : (bf16 ? 2e-2 : 1e-4);

  const io::ComponentFolder component = io::open_component(options.model, "transformer");
  const auto inputs = io::SafetensorsFile::open(read_case_inputs(options.inputs, component).file);
  std::shared_ptr<parallel::TensorParallelModule> model = models::create_transformer(component);
  const parallel::LoadOptions load_options = command_load_options(world, dtype, /*tp=*/0);
  model->load(component.weights(), load_options);

  at::Tensor reference;
  {
    nn::AttentionBackendGuard guard("math");
    reference = verify::forward_from_file(*model, *inputs).to(at::kDouble);
  }
  bool all_pass = true;
  if (world.rank() == 0) {
    fmt::print("{} ({}, tp {}): each attention backend against math, pass when |diff| <= {:g} + {:g} * |math|\n",
               model->type_name(), options.dtype, world.size(), atol, rtol);
    fmt::print("{:<18} {:>12} {:>12} {:>6}  {}\n", "backend", "max |diff|", "mean |diff|", "result", "ran");
  }
  for (const std::string& name : nn::attention_backend_names()) {
    nn::AttentionBackendGuard guard(name);
    nn::reset_attention_dispatch_counts();
    at::Tensor sample;
    try {
      sample = verify::forward_from_file(*model, *inputs).to(at::kDouble);
    } catch (const c10::Error& error) {
      // A backend that cannot take this model's calls (amx in f32, or on a CPU without AMX)
      // says why; that is a row of the table, not a failure. Any other error is one.
      const std::string message = error.what_without_backtrace();
      const std::string refusal = "attention backend '" + name + "' cannot run this call";
      if (message.find(refusal) == std::string::npos) throw;
      const size_t reason = message.find("): ");
      const size_t end = message.find("; choose another");
      if (world.rank() == 0) {
        fmt::print("{:<18} {:>12} {:>12} {:>6}  {}\n", name, "-", "-", "n/a",
                   reason == std::string::npos ? message : message.substr(reason + 3, end - reason - 3));
      }
      continue;
    }
    const auto counts = nn::attention_dispatch_counts();
    const at::Tensor diff = (sample - reference).abs();
    const double max_diff = diff.max().item<double>();
    const double mean_diff = diff.mean().item<double>();
    const bool within = diff.le(atol + rtol * reference.abs()).all().item<bool>() && std::isfinite(max_diff);
    // A backend whose calls went elsewhere was not checked.
    const bool ran_itself = counts.size() == 1 && counts.count(name) == 1;
    const bool pass = within && ran_itself;
    all_pass = all_pass && pass;
    if (world.rank() == 0) {
      fmt::print("{:<18} {:>12.3e} {:>12.3e} {:>6}  {}\n", name, max_diff, mean_diff, pass ? "pass" : "FAIL",
                 counts_text(counts));
    }
  }
  return all_pass ? 0 : 1;
}

}  // namespace

void register_check_backends(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<CheckBackendsOptions>();
  CLI::App* command = app.add_subcommand(
      "check-backends", "run a transformer once per attention backend and compare each with the math backend");
  command->add_option("--model", options->model,
                      "transformer component folder (or pipeline folder); default: the built-in tiny model");
  command->add_option("--inputs", options->inputs,
                      "case folder with inputs.safetensors, or the file; default: the model folder");
  command->add_option("--dtype", options->dtype, "compute dtype: f32 or bf16");
  command->add_option("--atol", options->atol, "absolute tolerance (default 1e-4 in f32, 2e-2 in bf16)")
      ->check(number_in(0, 1e6));
  command->add_option("--rtol", options->rtol, "relative tolerance (default 1e-4 in f32, 2e-2 in bf16)")
      ->check(number_in(0, 1e6));
  command->callback([&body, options] { body = [options] { return check_backends(*options); }; });
}

}  // namespace shardit::apps
