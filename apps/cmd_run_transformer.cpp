// `shardit run-transformer`: one forward of a diffusers transformer on a golden-style case folder
// (inputs.safetensors with the forward's keyword tensors, inputs.json with the rest). Under a
// multi-rank launch every rank runs the model sharded over the world (TP degree = world size);
// rank 0 writes the sample.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <memory>
#include <string>

#include "apps/commands.h"
#include "shardit/core/dtype.h"
#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/models/registry.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::apps {

namespace {

struct RunTransformerOptions {
  std::string model;
  std::string inputs;
  std::string out;
  std::string dtype = "f32";
};

int run_transformer(const RunTransformerOptions& given) {
  dist::World& world = dist::World::get();
  RunTransformerOptions options = given;
  if (options.model.empty()) {
    // The built-in tiny model and its input case (written once; ranks share the folder).
    TORCH_CHECK(options.inputs.empty(), "run-transformer: --inputs without --model; give both, or neither for the "
                                        "built-in tiny model");
    const auto builtin = models::write_builtin_model(models::default_builtin_model_root());
    options.model = builtin.pipeline;
    options.inputs = builtin.inputs;
    if (world.rank() == 0) fmt::print("(no --model given: running the built-in tiny model)\n");
  }
  TORCH_CHECK(!options.inputs.empty(), "run-transformer: --inputs is required with --model");
  const at::ScalarType dtype = parse_compute_dtype(options.dtype);

  const io::ComponentFolder component = io::open_component(options.model, "transformer");
  std::shared_ptr<parallel::TensorParallelModule> model = models::create_transformer(component);

  const std::string inputs_path = case_inputs_file(options.inputs, component);
  const auto inputs_file = io::SafetensorsFile::open(inputs_path);

  parallel::LoadOptions load_options;
  load_options.dtype = dtype;
  load_options.device = world.device();
  if (world.size() > 1) load_options.tensor_parallel = parallel::TensorParallelConfig::from_degree(world.size());

  const auto load_start = std::chrono::steady_clock::now();
  model->load(component.weights(), load_options);
  const auto forward_start = std::chrono::steady_clock::now();

  const at::Tensor sample = models::forward_from_file(*model, *inputs_file);
  const auto end = std::chrono::steady_clock::now();

  if (world.rank() == 0) {
    // Written as float32 whatever the compute dtype (bf16 -> f32 is exact).
    io::save_safetensors(options.out, {{"sample", sample.to(at::kCPU, at::kFloat).contiguous()}});
    const auto seconds = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    fmt::print("{} ({}, tp {}): sample {} in {:.3f} s (load {:.3f} s) -> {}\n", model->type_name(), options.dtype,
               world.size(), fmt::join(sample.sizes(), "x"), seconds(forward_start, end),
               seconds(load_start, forward_start), options.out);
  }
  return 0;
}

}  // namespace

void register_run_transformer(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<RunTransformerOptions>();
  CLI::App* command =
      app.add_subcommand("run-transformer", "run one transformer forward on a case folder and write `sample`");
  command->add_option("--model", options->model,
                      "transformer component folder (or pipeline folder); default: the built-in tiny model");
  command->add_option("--inputs", options->inputs,
                      "case folder with inputs.safetensors (+ inputs.json), or the file; required with --model");
  command->add_option("--out", options->out, "output .safetensors file (tensor `sample`, float32)")->required();
  command->add_option("--dtype", options->dtype, "compute dtype: f32 or bf16");
  command->callback([&body, options] { body = [options] { return run_transformer(*options); }; });
}

}  // namespace shardit::apps
