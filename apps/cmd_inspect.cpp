// `shardit inspect <path>`: the config and tensor table of a .safetensors file, a component folder
// or a diffusers pipeline folder.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "apps/commands.h"
#include "shardit/core/units.h"
#include "apps/inspect_plan.h"
#include "shardit/core/dtype.h"
#include "shardit/core/error.h"
#include "shardit/dist/world.h"
#include "shardit/io/gguf.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/models/lora_formats.h"
#include "shardit/models/registry.h"

namespace shardit::apps {

namespace {

namespace fs = std::filesystem;

struct InspectOptions {
  std::string path;
  bool plan = false;
  int tp = 1;
  int text_encoder_tp = 0;  ///< --plan: the text encoders' degree; 0: as a pipeline chooses it
  std::string dtype;  ///< byte counts of --plan in this dtype; "": the checkpoint's
  std::string weights_dtype = "checkpoint";  ///< --plan: the transformer's Linears in 8 bits (fp8, int8)
  std::string tp_plan = "full";
  bool json = false;  ///< --plan: only the memory summary, as JSON
  int64_t height = 0;  ///< with --width: activation estimates of one step
  int64_t width = 0;
  int64_t batch = 1;
  int64_t text_tokens = 512;
  std::string attention = "math";
  double device_memory = 0;  ///< GiB; > 0: a verdict per TP degree
  std::string model;  ///< the transformer a LoRA file is inspected for
  std::string transformer_file;  ///< --transformer FILE: the transformer's weights from a single file
};

/// The component's weights: the folder's, or for the transformer with --transformer, the single
/// file mapped to the model's names (a file of another family is refused here).
io::Checkpoint weights_of(const io::ComponentFolder& component, const InspectOptions& options) {
  const models::ComponentClass* entry = find_module_class(component.class_name());
  if (options.transformer_file.empty() || entry == nullptr || entry->kind != models::ComponentKind::Transformer) {
    return component.weights();
  }
  const auto model = entry->create_module(component);
  return models::open_transformer_file(options.transformer_file, component.class_name(), *model);
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

/// name | dtype | shape | bytes, then the totals.
void print_tensor_table(const io::Checkpoint& checkpoint) {
  const auto names = checkpoint.names();
  size_t name_width = 4;
  size_t shape_width = 5;
  for (const auto& name : names) {
    name_width = std::max(name_width, name.size());
    shape_width = std::max(shape_width, shape_string(checkpoint.info(name).shape).size());
  }
  fmt::print("{:<{}}  {:<7}  {:<{}}  {:>12}\n", "name", name_width, "dtype", "shape", shape_width, "bytes");
  uint64_t total_bytes = 0;
  int64_t total_elements = 0;
  for (const auto& name : names) {
    const io::TensorInfo& info = checkpoint.info(name);
    const char* dtype = info.is_gguf_blocks() ? io::ggml_type_name(static_cast<io::GgmlType>(info.ggml_block_type))
                                              : io::st_dtype_name(info.dtype);
    fmt::print("{:<{}}  {:<7}  {:<{}}  {:>12}\n", name, name_width, dtype,
               shape_string(info.shape), shape_width, info.nbytes());
    total_bytes += info.nbytes();
    total_elements += info.numel();
  }
  fmt::print("total: {} tensors, {} elements, {} bytes ({}) in {} file(s)\n", names.size(),
             total_elements, total_bytes, human_bytes(total_bytes), checkpoint.file_paths().size());
}

/// The dtype the checkpoint stores its floating-point weights in (the most bytes), fp32 when it
/// has none or the weights cannot be opened.
at::ScalarType checkpoint_dtype(const io::ComponentFolder& component, const InspectOptions& options) {
  try {
    const io::Checkpoint weights = weights_of(component, options);
    std::map<at::ScalarType, uint64_t> bytes;
    for (const auto& name : weights.names()) {
      const io::TensorInfo& info = weights.info(name);
      // FP8 weights are held as they are; the compute dtype is that of the other floating tensors.
      if (!io::st_dtype_is_floating(info.dtype) || io::st_dtype_is_fp8(info.dtype)) continue;
      bytes[io::to_scalar_type(info.dtype)] += info.nbytes();
    }
    at::ScalarType best = at::kFloat;
    uint64_t most = 0;
    for (const auto& [type, count] : bytes) {
      if (count > most) std::tie(best, most) = std::make_pair(type, count);
    }
    return best;
  } catch (const std::exception&) {
    return at::kFloat;
  }
}

/// The tensor-parallel plan of the component's model class, resolved at `tp` (errors, such as a
/// degree that does not divide the heads, are the resolver's own), bytes in `--dtype` or the
/// checkpoint's dtype.
void print_plan(const std::optional<io::ComponentFolder>& component, const InspectOptions& options) {
  TORCH_CHECK(component.has_value(),
              "inspect --plan needs a model folder (config.json names the model class), not a bare weights file");
  const auto model = models::create_module_component(*component);
  const at::ScalarType dtype = options.dtype.empty() ? checkpoint_dtype(*component, options) : parse_compute_dtype(options.dtype);
  parallel::TpPlanKind kind = parallel::parse_tp_plan_kind(options.tp_plan);
  if (kind == parallel::TpPlanKind::Reference && model->reference_tp_plan() == nullptr) {
    fmt::print("({} has no reference plan: showing the full plan)\n", model->type_name());
    kind = parallel::TpPlanKind::Full;
  }
  // With --transformer, the transformer's weights as the file stores them and a load keeps them
  // (GGUF blocks, FP8 Linears).
  const models::ComponentClass* entry = find_module_class(component->class_name());
  const bool from_file = !options.transformer_file.empty() && entry != nullptr &&
                         entry->kind == models::ComponentKind::Transformer;
  const nn::WeightsDtype weights = nn::parse_weights_dtype(options.weights_dtype);
  const parallel::ResolvedPlan resolved =
      from_file ? model->resolve_as_stored(weights_of(*component, options), options.tp, dtype, kind, weights)
                : model->resolve(options.tp, dtype, kind, weights);
  fmt::print("tensor-parallel plan of {} at TP={} (plan '{}'{}):\n{}", model->type_name(), options.tp,
             parallel::tp_plan_kind_name(kind), from_file ? ", weights as " + options.transformer_file + " stores them" : "",
             resolved.to_table());
}

/// The summary's request: byte counts in --dtype, else the transformer checkpoint's dtype.
MemoryPlanRequest memory_plan_request(const io::ModelFolder& folder, const InspectOptions& options) {
  MemoryPlanRequest request;
  request.tp = options.tp;
  if (options.text_encoder_tp > 0) request.text_encoder_tp = options.text_encoder_tp;
  request.plan = parallel::parse_tp_plan_kind(options.tp_plan);
  request.weights = nn::parse_weights_dtype(options.weights_dtype);
  if (!options.dtype.empty()) {
    request.dtype = parse_compute_dtype(options.dtype);
  } else {
    // fp32 when there is no transformer or its folder cannot be opened (the summary names why).
    try {
      request.dtype = checkpoint_dtype(folder.component(folder.is_pipeline() ? "transformer" : ""), options);
    } catch (const std::exception&) {
      request.dtype = at::kFloat;
    }
  }
  TORCH_CHECK((options.height > 0) == (options.width > 0), "inspect --plan: give --height and --width together");
  if (options.height > 0) {
    models::StepShape step;
    step.height = options.height;
    step.width = options.width;
    step.batch = options.batch;
    step.text_tokens = options.text_tokens;
    step.attention_backend = options.attention;
    request.step = step;
  }
  if (options.device_memory > 0) request.device_memory_gib = options.device_memory;
  request.transformer_file = options.transformer_file;
  request.json = options.json;
  return request;
}

void print_component(const io::ComponentFolder& component, const InspectOptions& options,
                     bool tolerate_missing_weights) {
  const std::string class_name = component.class_name();
  fmt::print("== component '{}'{} at {}\n", component.name,
             class_name.empty() ? "" : " (" + class_name + ")", component.dir);
  fmt::print("config:\n{}\n", component.config.dump(2));
  // --plan needs config.json only.
  if (tolerate_missing_weights || options.plan) {
    try {
      const io::Checkpoint weights = component.weights();
      print_tensor_table(weights);
    } catch (const std::exception& e) {
      fmt::print("weights: none ({})\n", error_message(e));
    }
  } else {
    print_tensor_table(component.weights());
  }
  if (!options.transformer_file.empty() && find_module_class(class_name) != nullptr &&
      find_module_class(class_name)->kind == models::ComponentKind::Transformer) {
    // Errors (a missing file, another family) propagate: the command fails naming the file.
    fmt::print("transformer weights from {} (--transformer), under the model's names:\n", options.transformer_file);
    print_tensor_table(weights_of(component, options));
  }
  // In a pipeline only the classes with plan entries show a plan table; a component folder given
  // directly must be of a class the registry builds.
  if (!options.plan) return;
  const models::ComponentClass* entry = find_module_class(class_name);
  const bool has_plan = entry != nullptr && !entry->create_module(component)->tp_plan().empty();
  if (has_plan || !tolerate_missing_weights) print_plan(component, options);
}

/// A LoRA file converted for the transformer of `options.model`: format, rank, alpha, each
/// target with its source rows, and the bytes each rank reads at --tp.
void print_lora(const std::string& path, const InspectOptions& options) {
  const io::ComponentFolder component = io::open_component(options.model, "transformer");
  const auto model = models::create_transformer(component);
  const parallel::LoraAdapterSpec spec = models::read_lora_spec(path, *model);
  const at::ScalarType dtype = options.dtype.empty() ? at::kFloat : parse_compute_dtype(options.dtype);
  const parallel::ResolvedPlan plan = model->resolve(options.tp, dtype);
  fmt::print("LoRA for {}: format {}, rank {}, alpha {}\n", model->type_name(), spec.format, spec.rank,
             spec.alphas.empty() ? std::string("none (lora_alpha = r)") : fmt::format("{}", fmt::join(spec.alphas, ", ")));
  fmt::print("{} target modules:\n", spec.targets.size());
  for (const auto& target : spec.targets) {
    const std::string rows = target.lora_B.rows < 0 ? ""
                                                    : fmt::format(" rows [{}, {})", target.lora_B.row_begin,
                                                                  target.lora_B.row_begin + target.lora_B.rows);
    fmt::print("  {:<48} <- {}{} scaling {:g}\n", target.module, target.lora_B.key, rows,
               target.scaling * target.lora_A.factor * target.lora_B.factor);
  }
  for (const auto& key : spec.skipped) fmt::print("  skipped (diffusers does not load it): {}\n", key);
  const auto file = io::SafetensorsFile::open(path);
  const int64_t whole = parallel::lora_bytes_on_rank(spec, *file, model->resolve(1, dtype), 0);
  fmt::print("unsharded: {} bytes ({}) in {}\n", whole, human_bytes(whole), c10::toString(dtype));
  for (int rank = 0; rank < options.tp; ++rank) {
    const int64_t bytes = parallel::lora_bytes_on_rank(spec, *file, plan, rank);
    fmt::print("rank {} of TP={}: {} bytes ({}) in {}\n", rank, options.tp, bytes, human_bytes(bytes),
               c10::toString(dtype));
  }
}

int run_inspect(const InspectOptions& options) {
  if (options.path.empty()) {
    InspectOptions builtin = options;
    builtin.path = models::write_builtin_model(models::default_builtin_model_root()).pipeline;
    fmt::print("(no path given: inspecting the built-in tiny model)\n");
    return run_inspect(builtin);
  }
  TORCH_CHECK(fs::exists(fs::symlink_status(options.path)), options.path, ": no such file or directory");

  TORCH_CHECK(options.transformer_file.empty() || fs::is_directory(options.path), "inspect --transformer ",
              options.transformer_file, ": give the model folder whose transformer config the file fits as the path, "
              "not ", options.path);
  if (!fs::is_directory(options.path)) {
    const io::Checkpoint checkpoint = io::Checkpoint::open(options.path);
    fmt::print("== {}\n", options.path);
    for (const auto& file : checkpoint.files()) {
      if (file->metadata().empty()) continue;
      fmt::print("metadata of {}:\n", file->path());
      // Metadata is free text from the file: shown quoted, control characters escaped.
      for (const auto& [key, value] : file->metadata()) fmt::print("  {}: {}\n", io::quoted(key), io::quoted(value));
    }
    print_tensor_table(checkpoint);
    if (!options.model.empty()) {
      print_lora(options.path, options);
    } else if (options.plan) {
      print_plan(std::nullopt, options);
    }
    return 0;
  }

  const io::ModelFolder folder = io::ModelFolder::open(options.path);
  if (options.plan && options.json) {
    print_memory_plan(folder, memory_plan_request(folder, options));
    return 0;
  }
  if (!folder.is_pipeline()) {
    print_component(folder.component(""), options, /*tolerate_missing_weights=*/false);
    if (options.plan) print_memory_plan(folder, memory_plan_request(folder, options));
    return 0;
  }
  fmt::print("== pipeline at {}\nmodel_index.json:\n{}\n", folder.root(), folder.model_index().dump(2));
  int status = 0;
  // The text encoders' plans at their own degree, as the pipeline loads them.
  int text_degree = options.tp;
  if (options.plan) {
    try {
      text_degree = options.text_encoder_tp > 0 ? options.text_encoder_tp
                                                : text_encoder_degree(folder, options.tp, at::kFloat);
    } catch (const std::exception&) {
      // A component that cannot be planned is reported below, by the loop that shows it.
    }
  }
  for (const auto& name : folder.components()) {
    // Schedulers and tokenizers have no weights; a missing component folder is reported and
    // makes the command fail, after the other components were shown.
    try {
      const io::ComponentFolder component = folder.component(name);
      const models::ComponentClass* entry = find_module_class(component.class_name());
      if (options.plan && entry != nullptr && entry->kind == models::ComponentKind::TextEncoder &&
          text_degree != options.tp) {
        InspectOptions at_text_degree = options;
        at_text_degree.tp = text_degree;
        fmt::print("({} at TP={}: {})\n", name, text_degree,
                   options.text_encoder_tp > 0 ? "--text-encoder-tp"
                                               : "the largest degree dividing --tp that the text encoders' heads allow, "
                                                 "as the pipeline loads them; --text-encoder-tp sets it");
        print_component(component, at_text_degree, /*tolerate_missing_weights=*/true);
        continue;
      }
      print_component(component, options, /*tolerate_missing_weights=*/true);
    } catch (const std::exception& e) {
      fmt::print("== component '{}': {}\n", name, error_message(e));
      status = 1;
    }
  }
  if (options.plan && status == 0) print_memory_plan(folder, memory_plan_request(folder, options));
  return status;
}

}  // namespace

void register_inspect(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<InspectOptions>();
  CLI::App* command = app.add_subcommand(
      "inspect", "Show the config and tensors of a .safetensors file, a component folder or a pipeline folder");
  command->add_option("path", options->path, "a .safetensors (or .safetensors.index.json) file, or a model folder (default: the built-in tiny model)");
  command->add_flag("--plan", options->plan, "also show the tensor-parallel plan resolved for --tp");
  add_transformer_file_option(command, options->transformer_file);
  command->add_option("--model", options->model,
                      "for a LoRA file: the transformer (component or pipeline folder) it is for; prints its format, "
                      "rank, alpha, targets and the bytes per rank at --tp (with --plan)");
  command->add_option("--tp", options->tp, "tensor-parallel degree for --plan (1 to 4096)")
      ->check(integer_in(1, 4096))
      ->needs("--plan");
  command->add_option("--dtype", options->dtype,
                      "dtype of the --plan byte counts: f32, bf16 or f16 (default: the checkpoint's)");
  command
      ->add_option("--weights-dtype", options->weights_dtype,
                   "with --plan: count the transformer's Linears as --weights-dtype loads them: checkpoint (as "
                   "stored), fp8 or int8 (1 byte each; the model's high-precision layers stay in --dtype)")
      ->check(CLI::IsMember({"checkpoint", "fp8", "int8"}))
      ->needs("--plan");
  command->add_option("--text-encoder-tp", options->text_encoder_tp,
                      "with --plan: the text encoders' tensor-parallel degree (default: the largest divisor of --tp "
                      "their heads allow, as generate chooses it)")
      ->check(integer_in(1, 4096))
      ->needs("--plan");
  command->add_option("--tp-plan", options->tp_plan,
                      "full (ours: modulation sharded too) or reference (diffusers' _tp_plan); the summary shows both")
      ->check(CLI::IsMember({"full", "reference"}))
      ->needs("--plan");
  command->add_flag("--json", options->json, "with --plan: print only the memory summary, as JSON")->needs("--plan");
  command->add_option("--height", options->height, "with --plan: image height in pixels for the activation estimate")
      ->check(integer_in(16, int64_t{1} << 16))
      ->needs("--plan");
  command->add_option("--width", options->width, "with --plan: image width in pixels")
      ->check(integer_in(16, int64_t{1} << 16))
      ->needs("--plan");
  command->add_option("--batch", options->batch, "with --height/--width: batch size (1 to 1024)")
      ->check(integer_in(1, 1024))
      ->needs("--plan");
  command->add_option("--text-tokens", options->text_tokens, "with --height/--width: text sequence length (default 512)")
      ->check(integer_in(0, int64_t{1} << 16))
      ->needs("--plan");
  command->add_option("--attention", options->attention,
                      "with --height/--width: attention backend of the estimate, math or memory_efficient")
      ->check(CLI::IsMember({"math", "memory_efficient"}))
      ->needs("--plan");
  command->add_option("--device-memory", options->device_memory,
                      "with --plan: device memory in GiB; prints whether each TP degree fits, and the headroom")
      ->check(number_in(0.001, 1.0e6))
      ->needs("--plan");
  command->callback([&body, options] {
    body = [options] {
      // inspect reads files and prints; it needs no peers. Under a multi-rank launch only rank 0
      // runs it, so the report is printed once.
      if (dist::World::get().rank() != 0) return 0;
      const int status = run_inspect(*options);
      std::fflush(stdout);
      return status;
    };
  });
}

}  // namespace shardit::apps
