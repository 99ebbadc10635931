// `shardit run-encoder`: a text encoder (CLIPTextModel, T5EncoderModel, Qwen3ForCausalLM,
// Qwen2_5_VLForConditionalGeneration, Mistral3ForConditionalGeneration) on a golden-style case
// folder (inputs.safetensors with input_ids and attention_mask), every output written under its
// golden name. Under a multi-rank
// launch every rank runs the encoder sharded (TP degree = world size, or --tp); rank 0 writes.
#include <fmt/format.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "apps/commands.h"
#include "shardit/core/dtype.h"
#include "shardit/dist/world.h"
#include "shardit/io/file.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/verify/encoder_case.h"

namespace shardit::apps {

namespace {

struct RunEncoderOptions {
  std::string model;
  std::string inputs;
  std::string out;
  std::string dtype = "f32";
  int tp = 0;  ///< 0: the world size
};

int run_encoder(const RunEncoderOptions& options) {
  dist::World& world = dist::World::get();
  const at::ScalarType dtype = parse_compute_dtype(options.dtype);
  // Everything is opened and checked before any rank waits on another.
  const io::ComponentFolder component = io::open_component(options.model, "text_encoder");
  const io::Checkpoint weights = component.weights();
  const std::string inputs_path = read_case_inputs(options.inputs, component).file;
  const auto inputs = io::SafetensorsFile::open(inputs_path);
  if (world.rank() == 0) {
    std::vector<std::string> read = {inputs_path, options.model, component.dir, options.inputs, weights.path()};
    for (const auto& file : weights.files()) read.push_back(file->path());
    io::check_output_path(options.out, read);
  }
  std::shared_ptr<parallel::TensorParallelModule> encoder = models::create_text_encoder(component);

  world.agree("compute dtype", options.dtype);
  world.agree("model config", component.class_name() + " " + component.config.dump());
  world.agree("weights", tensor_table(weights));
  world.agree("inputs", tensor_table(*inputs));

  const parallel::LoadOptions load_options = command_load_options(world, dtype, options.tp);
  const int tp = load_options.tensor_parallel ? load_options.tensor_parallel->tp_degree() : 1;

  const auto load_start = std::chrono::steady_clock::now();
  encoder->load(weights, load_options);
  const auto forward_start = std::chrono::steady_clock::now();
  std::map<std::string, at::Tensor> outputs = verify::run_encoder_case(*encoder, *inputs);
  const auto end = std::chrono::steady_clock::now();

  if (world.rank() == 0) {
    std::vector<std::pair<std::string, at::Tensor>> tensors(outputs.begin(), outputs.end());
    io::save_safetensors(options.out, tensors);
    const auto seconds = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    fmt::print("{} ({}, tp {} of {} ranks): {} outputs in {:.3f} s (load {:.3f} s) -> {}\n", encoder->type_name(),
               options.dtype, tp, world.size(), tensors.size(), seconds(forward_start, end),
               seconds(load_start, forward_start), options.out);
  }
  return 0;
}

}  // namespace

void register_run_encoder(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<RunEncoderOptions>();
  CLI::App* command = app.add_subcommand(
      "run-encoder", "run a text encoder on a case folder and write its outputs under the golden names");
  command->add_option("--model", options->model, "text encoder folder (or pipeline folder with text_encoder/)")
      ->required();
  command->add_option("--inputs", options->inputs,
                      "case folder with inputs.safetensors (input_ids, attention_mask), or the file")
      ->required();
  command->add_option("--out", options->out, "output .safetensors file (float32; token positions int64)")->required();
  command->add_option("--dtype", options->dtype, "compute dtype: f32 or bf16");
  command->add_option("--tp", options->tp,
                      "tensor-parallel degree, dividing the number of ranks (default: all ranks); the other "
                      "ranks hold replicas")
      ->check(integer_in(1, kMaxParallelDegree));
  command->callback([&body, options] { body = [options] { return run_encoder(*options); }; });
}

}  // namespace shardit::apps
