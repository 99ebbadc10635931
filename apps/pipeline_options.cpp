// How every command turns its parallel flags into ranks, in one place:
//
//   --cfg-parallel --ulysses --ring --tp  ->  ParallelDims  ->  ParallelDims::build(world)
//     -> ParallelLayout {dims, mesh}  ->  PipelineLoadOptions::parallel (generate, serve)
//                                     ->  parallel::LoadOptions::tensor_parallel (run-*, check-backends)
//
// and the options generate, serve and run-transformer share (dtype, mesh, VAE, LoRA), which the
// benchmark (bench/shardit_bench.cpp) reuses: the dtype, the mesh, the step cache and the backends.
#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>

#include "apps/commands.h"
#include "shardit/core/dtype.h"
#include "shardit/dist/mesh.h"
#include "shardit/io/json.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/nn/gemm.h"

namespace shardit::apps {

parallel::ParallelDims PipelineCliOptions::dims() const {
  return parallel::ParallelDims{cfg_parallel ? 2 : 1, ulysses, ring, tp};
}

parallel::LoadOptions command_load_options(dist::World& world, at::ScalarType dtype, int tp) {
  parallel::LoadOptions options;
  options.dtype = dtype;
  options.device = world.device();
  // A model command has only a tp dimension (0: the whole world); the rest of the world holds replicas.
  options.tensor_parallel = parallel::ParallelDims{1, 1, 1, tp}.build(world).tensor_parallel();
  return options;
}

pipelines::PipelineLoadOptions pipeline_load_options(dist::World& world, const PipelineCliOptions& options,
                                                     int replicas) {
  pipelines::PipelineLoadOptions load;
  load.dtype = parse_compute_dtype(options.dtype);
  load.device = world.device();
  load.vae_tiling = options.tiled_vae;
  load.vae_parallel = options.vae_parallel;
  parallel::ParallelDims dims = options.dims();
  dims.replicas = replicas;
  load.parallel = dims.build(world);  // wrong degrees fail here, naming the flags
  if (options.text_encoder_tp > 0) load.text_encoder_tp = options.text_encoder_tp;
  load.lora = lora_requests(options.lora);
  load.lora_scale = options.lora.scale;
  load.fuse_lora = options.lora.fuse;
  if (!options.pipeline_class.empty()) load.pipeline_class = options.pipeline_class;
  if (!options.transformer_file.empty()) load.transformer_file = options.transformer_file;
  load.weights = nn::parse_weights_dtype(options.weights_dtype);
  load.int8_compute = options.int8_compute;
  return load;
}

void add_transformer_file_option(CLI::App* command, std::string& file) {
  command->add_option("--transformer", file,
                      "the transformer's weights from this single .safetensors file instead of the folder's "
                      "transformer/ (Black Forest Labs' FLUX.1 / FLUX.2 files, ComfyUI's, FP8 ones included; "
                      "the rest, and the transformer's config, from --model); see docs/checkpoints.md");
}

void add_dtype_option(CLI::App* command, std::string& dtype) {
  command->add_option("--dtype", dtype, "compute dtype: f32 or bf16");
}

void add_parallel_options(CLI::App* command, PipelineCliOptions& options) {
  command
      ->add_option("--tp", options.tp,
                   "transformer tensor-parallel degree (default: the ranks --cfg-parallel, --ulysses and --ring "
                   "leave); cfg x ulysses x ring x tp must divide the number of ranks")
      ->check(integer_in(1, kMaxParallelDegree));
  command->add_option("--ulysses", options.ulysses, "Ulysses (all-to-all) context-parallel degree")
      ->check(integer_in(1, kMaxParallelDegree));
  command->add_option("--ring", options.ring, "ring-attention context-parallel degree")->check(integer_in(1, kMaxParallelDegree));
  command->add_flag("--cfg-parallel", options.cfg_parallel,
                    "run the conditional and unconditional CFG branches on the two halves of the ranks");
}

void add_cache_option(CLI::App* command, std::string& cache) {
  command
      ->add_option("--cache", cache,
                   "step caching, diffusers' configs: first_block_cache:threshold=0.12, or "
                   "taylorseer_lite:cache_interval=5,disable_cache_before_step=3,max_order=1"
                   "[,disable_cache_after_step=N] (see docs/step_caching.md)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            return text.empty() ? "is empty; give KIND:key=value,... or leave --cache out for no step cache" : "";
          },
          "KIND:key=value,..."));
}

void add_pipeline_options(CLI::App* command, PipelineCliOptions& options) {
  command->add_option("--pipeline", options.pipeline_class,
                      "load the folder as this pipeline class instead of the one model_index.json names, e.g. "
                      "FluxKontextPipeline on a FLUX.1 folder (diffusers' FluxKontextPipeline.from_pretrained)");
  add_transformer_file_option(command, options.transformer_file);
  add_dtype_option(command, options.dtype);
  add_weights_dtype_option(command, options.weights_dtype, options.int8_compute);
  add_parallel_options(command, options);
  command
      ->add_option("--text-encoder-tp", options.text_encoder_tp,
                   "text encoders' tensor-parallel degree, dividing the number of ranks (default: the largest "
                   "such degree their heads allow)")
      ->check(integer_in(1, kMaxParallelDegree));
  command->add_flag("--tiled-vae", options.tiled_vae, "decode in tiles (diffusers' vae.enable_tiling())");
  command->add_flag("--vae-parallel", options.vae_parallel, "decode on all ranks together, each a band of the image's rows")
      ->excludes("--tiled-vae");
  add_cache_option(command, options.cache);
  add_lora_options(command, options.lora);
}

void add_backend_options(CLI::App* app, BackendCliOptions& options) {
  // The names come from the registry, so the help lists exactly the backends of this build.
  app->add_option("--attention-backend", options.attention,
                  "attention backend: auto (the device's default, the first that takes each call) or one of " +
                      fmt::format("{}", fmt::join(nn::attention_backend_names(), ", ")) +
                      " (amx and avx512_bf16 on CPUs with them, sdpa where LibTorch has it); default auto, or "
                      "SHARDIT_ATTENTION_BACKEND");
  app->add_option("--gemm-backend", options.gemm,
                  "kernel of the matrix products on CPU: auto (from what the CPU is: fp32 on oneDNN for large products "
                  "where the BLAS library's core is older than the CPU's vector set, else BLAS; large bf16 Linears on "
                  "shardit's AMX kernel where the CPU has AMX-BF16), blas, onednn, or amx (every bf16 Linear it "
                  "takes); default auto, or SHARDIT_GEMM_BACKEND");
}

void BackendCliOptions::apply() const {
  if (!attention.empty()) nn::set_attention_backend(attention);
  // Without the option the selection comes from SHARDIT_GEMM_BACKEND: read it now, so that a bad
  // value fails here and not at the first large product, after the weights are loaded.
  if (gemm.empty()) {
    nn::gemm_backend_selection();
  } else {
    nn::set_gemm_backend(nn::parse_gemm_backend(gemm));
  }
}

std::string PipelineCliOptions::agreement() const {
  return fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}", pipeline_class, transformer_file, dtype, weights_dtype, int8_compute,
                     dims().to_string(), text_encoder_tp, tiled_vae, vae_parallel, cache,
                     fmt::join(lora.files, "\x1f"), lora.scale, lora.fuse);
}

std::optional<models::StepCacheConfig> PipelineCliOptions::cache_config() const {
  if (cache.empty()) return std::nullopt;
  return models::StepCacheConfig::parse(cache);
}

void add_weights_dtype_option(CLI::App* command, std::string& weights_dtype, bool& int8_compute) {
  command
      ->add_option("--weights-dtype", weights_dtype,
                   "the transformer's Linear weights in memory: checkpoint (as stored: F8_E4M3/F8_E5M2 stay 8-bit, "
                   "the rest --dtype), fp8 or int8 (quantized on load, per-row scales; the model's embedders, "
                   "modulation and output head stay in --dtype); see docs/quantization.md")
      ->check(CLI::IsMember({"checkpoint", "fp8", "int8"}));
  command->add_flag("--int8-compute", int8_compute,
                    "with --weights-dtype int8, on CPU: multiply the int8 weights by int8 activations (each token "
                    "quantized with its own scale) in LibTorch's quantized engine instead of dequantizing them; see "
                    "docs/quantization.md");
}

models::LoraRequest parse_lora_request(const std::string& argument) {
  models::LoraRequest request{argument, 1.0, ""};
  const size_t colon = argument.rfind(':');
  if (colon == std::string::npos || colon == 0) return request;
  const std::string tail = argument.substr(colon + 1);
  double weight = 0;
  if (parse_decimal_number(tail, weight)) return {argument.substr(0, colon), weight, ""};
  // What strtod would take whole (a hexadecimal float, inf, nan, an overflow) is a weight
  // mistyped, not part of a file name.
  char* end = nullptr;
  std::strtod(tail.c_str(), &end);
  const bool looks_numeric = !tail.empty() && end == tail.c_str() + tail.size() && !std::isspace(static_cast<unsigned char>(tail[0]));
  TORCH_CHECK(!looks_numeric, "--lora ", io::brief(nlohmann::json(argument)), ": the weight ",
              io::brief(nlohmann::json(tail)), " is not a finite decimal number; write it like 0.8 or 1.5e-1");
  return request;
}

std::vector<models::LoraRequest> lora_requests(const LoraCliOptions& options) {
  std::vector<models::LoraRequest> requests;
  for (const std::string& argument : options.files) requests.push_back(parse_lora_request(argument));
  return requests;
}

void add_lora_options(CLI::App* command, LoraCliOptions& options) {
  command->add_option("--lora", options.files,
                      "LoRA adapter FILE[:WEIGHT] for the transformer (repeatable; named after the file; weight 1 "
                      "by default)");
  command->add_option("--lora-scale", options.scale, "runtime scale multiplying every LoRA adapter");
  command->add_flag("--fuse-lora", options.fuse, "merge the LoRA adapters into the weights at load");
}

std::string model_folder_name(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path normal = fs::path(path).lexically_normal();
  return normal.filename().string().empty() ? normal.parent_path().filename().string() : normal.filename().string();
}

}  // namespace shardit::apps
