#pragma once
// The CLI's commands: each lives in its own apps/cmd_<name>.cpp behind a register_<name> declared
// here (main.cpp adds them all), and the options several commands share are made in one place
// (apps/pipeline_options.cpp). The CLI is thin: it parses, calls the library, prints.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/models/lora_formats.h"
#include "shardit/models/step_cache.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/pipelines/pipeline.h"

namespace shardit::apps {

/// A subcommand's body: runs after parsing; returns the process exit code.
using CommandBody = std::function<int()>;

// Checks of numeric options (apps/option_checks.cpp), on the text as given: every integer and
// number option goes through one of these instead of CLI11's own ranges.

/// A plain decimal integer (no '+', no leading zero or hex prefix) within [low, high]: "--steps: must be
/// an integer from 1 to 10000, got '0'".
CLI::Validator integer_in(int64_t low, int64_t high);
/// As integer_in for an unsigned 64-bit option (a seed): "-1" and 2^64 are refused, not wrapped.
CLI::Validator unsigned_in(uint64_t low, uint64_t high);
/// A finite number within [low, high], written as parse_decimal_number reads it.
CLI::Validator number_in(double low, double high);
/// `text` as a plain decimal number (-0.5, 12, 1e-3; no hexadecimal, inf, nan, '+' or spaces) that
/// is finite, into `value`; false when it is not one. Every number the command line takes is read
/// this way.
bool parse_decimal_number(const std::string& text, double& value);

/// The largest parallel degree an option accepts (--tp, --ulysses, --ring, --text-encoder-tp):
/// far beyond any world, small enough that products of degrees cannot overflow.
constexpr int64_t kMaxParallelDegree = 65536;

/// A golden-style case's inputs: the inputs.safetensors (`inputs`: the case folder or the file) and
/// the inputs.json next to it, checked against `component`'s class by its `model_class` when it
/// has one.
struct CaseInputs {
  std::string file;       ///< the inputs.safetensors
  std::string json_file;  ///< the inputs.json beside it (which may not exist)
  nlohmann::json meta = nlohmann::json::object();  ///< its contents; {} without one
};
CaseInputs read_case_inputs(const std::string& inputs, const io::ComponentFolder& component);

/// "name dtype [shape]" per tensor of a Checkpoint or SafetensorsFile, one per line: what two
/// ranks compare (World::agree) to know that they read the same tensors.
template <class File>
std::string tensor_table(const File& file) {
  std::string table;
  for (const auto& name : file.names()) {
    const io::TensorInfo& info = file.info(name);
    table += fmt::format("{} {} [{}]\n", name, io::st_dtype_name(info.dtype), fmt::join(info.shape, ", "));
  }
  return table;
}

// The parallel degrees and the options the commands share (apps/pipeline_options.cpp): every
// command turns its flags into ranks through these.

/// How a command loads its model: `dtype`, the world's device, and tensor parallelism over `tp`
/// ranks (0: the whole world; each block of `tp` ranks holds one replica), laid out by
/// ParallelDims::build like the pipelines' meshes (none on a world of one rank).
parallel::LoadOptions command_load_options(dist::World& world, at::ScalarType dtype, int tp);

/// `--lora FILE[:WEIGHT]`, `--lora-scale`, `--fuse-lora`.
struct LoraCliOptions {
  std::vector<std::string> files;  ///< FILE[:WEIGHT], as given
  double scale = 1.0;
  bool fuse = false;
};

/// Parses "FILE[:WEIGHT]": the part after the last ':' is the weight when it is a decimal number
/// (parse_decimal_number; so a path may hold ':'); without one, the weight is 1. A tail that C
/// would read as a number but is none here ("0x10", "inf", "1e999") is refused naming it.
models::LoraRequest parse_lora_request(const std::string& argument);
/// Every `--lora` of `options`, parsed.
std::vector<models::LoraRequest> lora_requests(const LoraCliOptions& options);
/// Adds --lora, --lora-scale and --fuse-lora.
void add_lora_options(CLI::App* command, LoraCliOptions& options);

/// Adds --weights-dtype (checkpoint, fp8, int8: nn::parse_weights_dtype) and --int8-compute to a
/// command.
void add_weights_dtype_option(CLI::App* command, std::string& weights_dtype, bool& int8_compute);

/// The options generate and serve share: how the pipeline is loaded and laid out on the ranks.
struct PipelineCliOptions {
  std::string dtype = "f32";
  int tp = 0;  ///< 0: the ranks cfg x ulysses x ring leave
  int ulysses = 1;
  int ring = 1;
  bool cfg_parallel = false;  ///< the CFG branches on the two halves of the mesh (cfg degree 2)
  int text_encoder_tp = 0;    ///< 0: the largest degree the text encoders' heads allow
  bool tiled_vae = false;
  bool vae_parallel = false;
  LoraCliOptions lora;
  std::string cache;  ///< --cache KIND:key=value,... as given; empty: no step cache
  std::string pipeline_class;  ///< --pipeline CLASS; empty: the class model_index.json names
  std::string transformer_file;  ///< --transformer FILE; empty: the folder's transformer weights
  std::string weights_dtype = "checkpoint";  ///< --weights-dtype: the transformer's Linears in 8 bits
  bool int8_compute = false;                 ///< --int8-compute: those Linears multiply in int8
  /// The mesh degrees (unresolved: tp 0 takes the rest of the world).
  parallel::ParallelDims dims() const;
  /// --cache parsed (errors name the key); nullopt without.
  std::optional<models::StepCacheConfig> cache_config() const;
  /// Every option as one string, for the ranks to compare (World::agree): ranks launched with
  /// different options would load different models or meet in collectives with different shapes.
  std::string agreement() const;
};

/// The load options of `options`: the dtype on the world's device, the transformer on the
/// cfg x ulysses x ring x tp mesh (built over the world: collective) in `replicas` copies (serve's
/// --replicas; 0: what the world leaves), the text encoders' degree, the VAE tiled or decoding in
/// parallel, the LoRA adapters.
pipelines::PipelineLoadOptions pipeline_load_options(dist::World& world, const PipelineCliOptions& options,
                                                     int replicas = 0);

/// Adds --pipeline, --dtype, --weights-dtype, --tp, --ulysses, --ring, --cfg-parallel, --text-encoder-tp,
/// --tiled-vae, --vae-parallel, --cache and the LoRA options to a pipeline command.
void add_pipeline_options(CLI::App* command, PipelineCliOptions& options);
/// Adds --dtype (the compute dtype: core's parse_compute_dtype).
/// `--transformer FILE`: the transformer's weights from a single file (generate, serve, run-transformer, inspect).
void add_transformer_file_option(CLI::App* command, std::string& file);
void add_dtype_option(CLI::App* command, std::string& dtype);
/// Adds the mesh degrees: --tp, --ulysses, --ring and --cfg-parallel (PipelineCliOptions::dims()).
void add_parallel_options(CLI::App* command, PipelineCliOptions& options);
/// Adds --cache (a step cache, PipelineCliOptions::cache_config()).
void add_cache_option(CLI::App* command, std::string& cache);

/// `--attention-backend NAME` and `--gemm-backend NAME`: the kernels every command computes with.
struct BackendCliOptions {
  std::string attention;  ///< empty: SHARDIT_ATTENTION_BACKEND, else auto
  std::string gemm;       ///< empty: SHARDIT_GEMM_BACKEND, else auto
  /// Selects the backends given (a bad name fails here, naming the choices), and reads the GEMM
  /// backend's environment variable now when none is given, so a bad value fails before any
  /// weight is read.
  void apply() const;
};
/// Adds --attention-backend and --gemm-backend (the attention names from the registry of this build).
void add_backend_options(CLI::App* app, BackendCliOptions& options);

/// The last component of a model folder's path ("FLUX.1-dev" for "models/FLUX.1-dev/"): the
/// model's name in PNG metadata and in the served API.
std::string model_folder_name(const std::string& path);

/// Adds `generate` (a text-to-image pipeline to PNG files).
void register_generate(CLI::App& app, CommandBody& body);
/// Adds `inspect` (checkpoint tensors, config, resolved TP plan).
void register_inspect(CLI::App& app, CommandBody& body);
/// Adds `run-encoder` (a text encoder on a golden-style case folder, outputs under golden names).
void register_run_encoder(CLI::App& app, CommandBody& body);
/// Adds `run-transformer` (one forward of a transformer on a golden-style case folder).
void register_run_transformer(CLI::App& app, CommandBody& body);
/// Adds `run-vae` (a VAE decode of a golden-style case folder, with intermediates).
void register_run_vae(CLI::App& app, CommandBody& body);
/// Adds `schedule` (a pipeline's scheduler schedule as JSON).
void register_schedule(CLI::App& app, CommandBody& body);
/// Adds `tokenize` (prompt ids as JSON, or a check of a tokenizer cases file).
void register_tokenize(CLI::App& app, CommandBody& body);
/// Adds `preprocess-image` (an input image as an editing pipeline prepares it, or a check of a
/// cases file).
void register_preprocess_image(CLI::App& app, CommandBody& body);
/// Adds `check-backends` (each attention backend against math on a model).
void register_check_backends(CLI::App& app, CommandBody& body);
/// Adds `serve` (an OpenAI-compatible images API over a pipeline).
void register_serve(CLI::App& app, CommandBody& body);
/// Adds `version` and the program's --version flag (nn/build_info.h's facts).
void register_version(CLI::App& app, CommandBody& body);
/// The facts `shardit version` prints, one "name: value" line each.
std::string version_text();

}  // namespace shardit::apps
