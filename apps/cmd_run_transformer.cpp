// `shardit run-transformer`: one forward of a diffusers transformer on a golden-style case folder
// (inputs.safetensors with the forward's keyword tensors, inputs.json with the rest). Under a
// multi-rank launch the model is sharded over --tp ranks (default: all of them; the other ranks
// hold replicas); rank 0 writes the sample.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "shardit/core/dtype.h"
#include "shardit/dist/world.h"
#include "shardit/io/file.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/models/lora_formats.h"
#include "shardit/models/registry.h"
#include "shardit/nn/inputs.h"
#include "shardit/verify/transformer_case.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::apps {

namespace {

struct RunTransformerOptions {
  std::string model;
  std::string transformer_file;  ///< --transformer FILE: the weights from a single file
  std::string inputs;
  std::string out;
  std::string dtype = "f32";
  std::string weights_dtype = "checkpoint";
  bool int8_compute = false;
  int tp = 0;  ///< 0: the world size
  bool check_finite = false;
  LoraCliOptions lora;
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

  // Everything is opened and checked before the model is built, loaded or run, and before any
  // rank waits on another: bad input fails in milliseconds, naming the file.
  const io::ComponentFolder component = io::open_component(options.model, "transformer");
  std::shared_ptr<parallel::TensorParallelModule> model = models::create_transformer(component);
  const io::Checkpoint weights = options.transformer_file.empty()
                                     ? component.weights()
                                     : models::open_transformer_file(options.transformer_file,
                                                                     component.class_name(), *model);
  const CaseInputs case_inputs = read_case_inputs(options.inputs, component);
  const auto inputs_file = io::SafetensorsFile::open(case_inputs.file);
  const std::vector<models::LoraRequest> loras = lora_requests(options.lora);
  if (world.rank() == 0) {
    std::vector<std::string> inputs = {case_inputs.file, case_inputs.json_file, options.model, component.dir, options.inputs,
                                       weights.path()};
    for (const std::string& file : weights.file_paths()) inputs.push_back(file);
    if (!options.transformer_file.empty()) inputs.push_back(options.transformer_file);
    for (const auto& lora : loras) inputs.push_back(lora.path);
    io::check_output_path(options.out, inputs);
  }
  const std::vector<models::LoraFile> adapter_files = models::open_lora_files(loras, *model);

  // Ranks given different work would meet in a collective with different shapes (a transport
  // error at best): agree first, through the store, and name the difference.
  world.agree("compute dtype", options.dtype);
  world.agree("weights dtype", options.weights_dtype + (options.int8_compute ? " int8-compute" : ""));
  world.agree("model config", component.class_name() + " " + component.config.dump());
  world.agree("weights", tensor_table(weights));
  world.agree("inputs", tensor_table(*inputs_file) + case_inputs.meta.dump());
  for (const models::LoraFile& adapter : adapter_files) {
    world.agree("LoRA " + adapter.spec.path, tensor_table(*adapter.file));
  }

  if (options.check_finite) {
    for (const auto& name : inputs_file->names()) {
      const std::string bad = nn::non_finite(inputs_file->read(name));
      TORCH_CHECK(bad.empty(), inputs_file->path(), ": input '", name, "': ", bad, " (--check-finite)");
    }
  }

  parallel::LoadOptions load_options = command_load_options(world, dtype, options.tp);
  load_options.weights = nn::parse_weights_dtype(options.weights_dtype);
  load_options.int8_compute = options.int8_compute;
  const int tp = load_options.tensor_parallel ? load_options.tensor_parallel->tp_degree() : 1;

  const auto load_start = std::chrono::steady_clock::now();
  model->load(weights, load_options);
  // Removes its unfused adapters from the model when it goes, after the forward.
  parallel::LoraAdapters adapters(*model);
  models::load_lora_files(adapters, adapter_files, options.lora.scale, options.lora.fuse);
  const auto forward_start = std::chrono::steady_clock::now();

  const at::Tensor sample = verify::forward_from_file(*model, *inputs_file);
  const auto end = std::chrono::steady_clock::now();

  if (world.rank() == 0) {
    const std::string bad = nn::non_finite(sample);
    TORCH_CHECK(bad.empty() || !options.check_finite, "the sample has non-finite values: ", bad,
                "; the weights or inputs hold NaN/Inf, or the computation overflowed (", options.dtype,
                "); nothing was written (--check-finite)");
    if (!bad.empty()) {
      fmt::print(stderr, "shardit: warning: the sample has non-finite values: {} (check the weights and inputs; "
                         "--check-finite makes this an error)\n", bad);
    }
    // Written as float32 whatever the compute dtype (bf16 -> f32 is exact).
    io::save_safetensors(options.out, {{"sample", sample.to(at::kCPU, at::kFloat).contiguous()}});
    const auto seconds = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    fmt::print("{} ({}, tp {} of {} ranks): sample {} in {:.3f} s (load {:.3f} s) -> {}\n", model->type_name(),
               options.dtype, tp, world.size(), fmt::join(sample.sizes(), "x"), seconds(forward_start, end),
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
  add_transformer_file_option(command, options->transformer_file);
  command->add_option("--inputs", options->inputs,
                      "case folder with inputs.safetensors (+ inputs.json), or the file; required with --model");
  command->add_option("--out", options->out, "output .safetensors file (tensor `sample`, float32)")->required();
  command->add_option("--dtype", options->dtype, "compute dtype: f32 or bf16");
  add_weights_dtype_option(command, options->weights_dtype, options->int8_compute);
  command->add_option("--tp", options->tp,
                      "tensor-parallel degree, dividing the number of ranks (default: all ranks); the other "
                      "ranks hold replicas")
      ->check(integer_in(1, kMaxParallelDegree));
  command->add_flag("--check-finite", options->check_finite,
                    "fail (writing nothing) when an input or the sample holds NaN or Inf; without it, a warning");
  add_lora_options(command, options->lora);
  command->callback([&body, options] { body = [options] { return run_transformer(*options); }; });
}

}  // namespace shardit::apps
