// shardit-bench: forward latency, memory per rank, communication, and the fraction of the
// machine's measured GEMM rate that a transformer forward reaches; and load time / peak RSS of
// the two tensor-parallel load paths. See docs/benchmarks.md.
//
//   shardit-bench forward [--nproc-per-node N] [--dtype f32|bf16] [--height 512 --width 512]
//                         [--text-tokens 512] [--double 2 --single 4] [--model <folder>]
//                         [--ulysses U --ring R]  (context parallel; TP = N / (U x R))
//                         [--lora-rank R]  (two unfused adapters, both active; times switching them)
//                         [--alternate SETTING=A,B]  (settings switched step by step, timed apart)
//   shardit-bench load    [--nproc-per-node N] --path shard-on-load|load-then-shard [...]
//   shardit-bench encoder [--nproc-per-node N] --encoder clip|t5|qwen3|qwen2_5_vl [--layers 2]
//                         [--text-tokens 512] [--dtype f32|bf16]
//   shardit-bench attention [--tokens 4608] [--heads 24] [--head-dim 128]  (one attention call)
//
// --attention-backend (auto, math, memory_efficient, sdpa where built) selects the attention
// backend of every subcommand.
//
// Without --model, both build a synthetic diffusers folder with FLUX.1-dev widths (3072 hidden,
// 24 heads x 128, MLP x4, joint_attention_dim 4096) and random bf16 weights, in sharded
// safetensors with an index, and reuse it on later runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shardit/nn/cpu/fused.h"
#include "shardit/core/dtype.h"
#include "shardit/core/error.h"
#include "shardit/core/profile.h"
#include "shardit/core/cpu_features.h"
#include "shardit/core/units.h"
#include "shardit/dist/launcher.h"
#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/clip/modeling_clip.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/models/registry.h"
#include "shardit/models/t5/modeling_t5.h"
#include "shardit/nn/module.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/nn/attention/bf16_kernels.h"
#include "shardit/nn/cpu/blas_core.h"
#include "shardit/nn/cpu/dispatch.h"
#include "shardit/nn/gemm.h"
#include "shardit/nn/program_start.h"
#include "shardit/nn/linear.h"
#include "shardit/models/lora_formats.h"
#include "shardit/parallel/lora.h"
#include "shardit/parallel/tensor_parallel.h"

#include "op_profile.h"

namespace {

namespace fs = std::filesystem;
using shardit::models::FluxTransformer2DModel;
using shardit::models::FluxTransformer2DModelConfig;
using Clock = std::chrono::steady_clock;

struct BenchOptions {
  std::string mode;  // forward | load | encoder | attention | gemm
  int nproc_per_node = 1;
  std::string model_dir;
  std::string cache_dir = (fs::temp_directory_path() / "shardit-bench").string();
  int num_double = 2;
  int num_single = 4;
  std::string dtype = "f32";
  std::string weights_dtype = "checkpoint";  // forward: --weights-dtype (8-bit Linears)
  bool int8_compute = false;                 // forward: --int8-compute
  int64_t gemm_tokens = 1536;                // gemm: rows of the input
  int64_t gemm_in = 3072;
  int64_t gemm_out = 3072;
  int height = 512;
  int width = 512;
  int text_tokens = 512;
  int batch = 1;
  int warmup = 1;
  std::string step_cache;  // forward: --cache KIND:key=value,...
  int repeats = 3;
  std::string load_path = "shard-on-load";
  std::string json_out;
  std::string label;
  bool profile = false;
  bool op_profile = false;
  std::string encoder = "t5";
  int encoder_layers = 2;
  std::string attention_backend = "auto";
  std::string gemm_backend = "auto";
  int attention_tokens = 4608;
  int attention_heads = 24;
  int attention_head_dim = 128;
  int ulysses = 1;
  int ring = 1;
  int lora_rank = 0;  // forward: two adapters of this rank, unfused and both active (0: none)
  std::string alternate;  // forward: SETTING=A,B,... switched step by step (AlternatedSetting)
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// `--alternate SETTING=A,B,...`: the timed steps take the values in turn (step i runs values[i %
/// k]), so every value meets the same drift of a shared machine, which separate runs do not (on
/// one machine the same step moved by 15% between runs of an hour apart, and effects of 1-2% were
/// invisible across runs but plain with the steps alternated). Settings that switch at run time:
/// fused-kernels (a build of nn/cpu, or off), gemm-backend, attention-backend.
class AlternatedSetting {
 public:
  AlternatedSetting() = default;
  explicit AlternatedSetting(const std::string& spec) {
    const size_t equals = spec.find('=');
    if (equals == std::string::npos) throw std::invalid_argument(invalid(spec, "no '='"));
    name_ = spec.substr(0, equals);
    std::string rest = spec.substr(equals + 1);
    for (size_t start = 0; start <= rest.size();) {
      const size_t comma = std::min(rest.find(',', start), rest.size());
      values_.push_back(rest.substr(start, comma - start));
      start = comma + 1;
    }
    if (values_.size() < 2) throw std::invalid_argument(invalid(spec, "give at least two values"));
    for (const std::string& value : values_) {
      if (value.empty()) throw std::invalid_argument(invalid(spec, "an empty value"));
    }
    if (name_ == "fused-kernels") {
      const std::vector<std::string> builds = shardit::nn::cpu::fused_kernel_builds();
      for (const std::string& value : values_) {
        if (std::find(builds.begin(), builds.end(), value) == builds.end()) {
          std::string names;
          for (const std::string& build : builds) names += (names.empty() ? "" : ", ") + build;
          throw std::invalid_argument(invalid(spec, "'" + value + "' is not a build this CPU runs (" + names + ")"));
        }
      }
    } else if (name_ == "gemm-backend") {
      for (const std::string& value : values_) shardit::nn::parse_gemm_backend(value);  // names the choices
    } else if (name_ == "attention-backend") {
      const std::string previous = shardit::nn::attention_backend_selection();
      for (const std::string& value : values_) shardit::nn::set_attention_backend(value);  // names the choices
      shardit::nn::set_attention_backend(previous);
    } else {
      throw std::invalid_argument(invalid(spec, "unknown setting '" + name_ +
                                                "'; choose fused-kernels, gemm-backend or attention-backend"));
    }
  }
  bool active() const { return !values_.empty(); }
  const std::string& name() const { return name_; }
  const std::vector<std::string>& values() const { return values_; }
  /// Makes `values()[index]` the setting of the steps that follow.
  void apply(size_t index) {
    const std::string& value = values_.at(index);
    if (name_ == "fused-kernels") {
      fused_.reset();  // restores the process's build before the next scope takes over
      fused_ = std::make_unique<shardit::nn::cpu::FusedKernelsScope>(value);
    } else if (name_ == "gemm-backend") {
      shardit::nn::set_gemm_backend(shardit::nn::parse_gemm_backend(value));
    } else {
      shardit::nn::set_attention_backend(value);
    }
  }

 private:
  static std::string invalid(const std::string& spec, const std::string& why) {
    return "--alternate '" + spec + "': " + why + " (expected SETTING=A,B[,...], e.g. fused-kernels=avx512,avx2)";
  }
  std::string name_;
  std::vector<std::string> values_;
  std::unique_ptr<shardit::nn::cpu::FusedKernelsScope> fused_;  // the build of fused-kernels now
};

/// An adapter of rank `rank` on every attention projection of every block of `config`'s model, in
/// diffusers' PEFT keys, written once by rank 0 under the cache folder (random, seeded by `seed`).
std::string bench_adapter(const BenchOptions& options, const FluxTransformer2DModelConfig& config, int seed,
                          shardit::dist::World& world) {
  const std::string path = (fs::path(options.cache_dir) / ("lora-r" + std::to_string(options.lora_rank) + "-d" +
                                                           std::to_string(options.num_double) + "-s" +
                                                           std::to_string(options.num_single) + "-" +
                                                           std::to_string(seed) + ".safetensors"))
                               .string();
  if (world.rank() == 0 && !fs::exists(path)) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    const int64_t width = config.inner_dim();
    std::vector<std::pair<std::string, at::Tensor>> factors;
    const auto add = [&](const std::string& module) {
      factors.emplace_back("transformer." + module + ".lora_A.weight",
                           at::normal(0.0, 0.01, {options.lora_rank, width}, generator));
      factors.emplace_back("transformer." + module + ".lora_B.weight",
                           at::normal(0.0, 0.01, {width, options.lora_rank}, generator));
    };
    for (int64_t i = 0; i < config.num_layers; ++i) {
      for (const char* m : {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"}) {
        add("transformer_blocks." + std::to_string(i) + ".attn." + m);
      }
    }
    for (int64_t i = 0; i < config.num_single_layers; ++i) {
      for (const char* m : {"to_q", "to_k", "to_v"}) add("single_transformer_blocks." + std::to_string(i) + ".attn." + m);
    }
    fs::create_directories(options.cache_dir);
    shardit::io::save_safetensors(path + ".partial", factors);
    fs::rename(path + ".partial", path);
  }
  world.group()->barrier();
  return path;
}

/// Peak resident set of this process so far, in bytes.
int64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

/// Peak resident set from /proc (VmHWM), which, unlike getrusage, reset_peak_rss() can reset.
int64_t vm_hwm_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmHWM:") {
      int64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

/// Resets VmHWM to the current resident set (Linux 4.0+: "5" to clear_refs).
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

/// Minor page faults of this process so far: every fresh page a new allocation touches (large
/// blocks come from mmap and go back to the kernel when freed, so each is faulted in again).
int64_t minor_page_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_minflt);
}

/// Current resident set, in bytes.
int64_t current_rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * sysconf(_SC_PAGESIZE);
}

/// The kernel's resident high-water mark (VmHWM), in bytes; -1 when it cannot be read.
int64_t resident_high_water_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

/// Resets VmHWM to the current resident set (Linux clear_refs 5); false where not supported.
bool reset_resident_high_water() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return clear_refs.good();
}

// ---------------------------------------------------------------------------------------------
// The synthetic checkpoint folder

nlohmann::json synthetic_config(const BenchOptions& options) {
  return {{"_class_name", "FluxTransformer2DModel"},
          {"patch_size", 1},
          {"in_channels", 64},
          {"out_channels", nullptr},
          {"num_layers", options.num_double},
          {"num_single_layers", options.num_single},
          {"attention_head_dim", 128},
          {"num_attention_heads", 24},
          {"joint_attention_dim", 4096},
          {"pooled_projection_dim", 768},
          {"guidance_embeds", true},
          {"axes_dims_rope", {16, 56, 56}}};
}

/// Writes a diffusers pipeline folder (model_index.json + transformer/) with random bf16 weights,
/// split into safetensors files of about `shard_bytes` with an index, as diffusers saves them.
void write_synthetic_folder(const fs::path& root, const nlohmann::json& config) {
  const fs::path transformer_dir = root / "transformer";
  fs::create_directories(transformer_dir);
  std::ofstream(root / "model_index.json")
      << nlohmann::json{{"_class_name", "FluxPipeline"}, {"transformer", {"diffusers", "FluxTransformer2DModel"}}}.dump(2);
  std::ofstream(transformer_dir / "config.json") << config.dump(2);

  FluxTransformer2DModel model(FluxTransformer2DModelConfig::from_json(config, "synthetic config"));
  auto slots = model.named_parameters();
  constexpr int64_t kShardBytes = int64_t{1} << 30;
  std::vector<std::vector<size_t>> shards(1);
  int64_t shard_fill = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t bytes = slots[i].tensor->numel() * 2;
    if (shard_fill > 0 && shard_fill + bytes > kShardBytes) {
      shards.emplace_back();
      shard_fill = 0;
    }
    shards.back().push_back(i);
    shard_fill += bytes;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total_bytes = 0;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1234);
  for (size_t s = 0; s < shards.size(); ++s) {
    char file_name[96];
    std::snprintf(file_name, sizeof(file_name), "diffusion_pytorch_model-%05zu-of-%05zu.safetensors", s + 1,
                  shards.size());
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (size_t i : shards[s]) {
      const auto& slot = slots[i];
      at::Tensor values = at::normal(0.0, 0.02, slot.tensor->sizes(), generator, at::TensorOptions().dtype(at::kFloat));
      if (slot.name.find("norm") != std::string::npos && slot.tensor->dim() == 1) values.fill_(1.0);
      tensors.emplace_back(slot.name, values.to(at::kBFloat16));
      weight_map[slot.name] = file_name;
      total_bytes += tensors.back().second.numel() * 2;
    }
    shardit::io::save_safetensors((transformer_dir / file_name).string(), tensors);
  }
  std::ofstream(transformer_dir / "diffusion_pytorch_model.safetensors.index.json")
      << nlohmann::json{{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}}.dump(2);
}

/// The model folder to benchmark: --model, or the synthetic one (made by rank 0 if missing).
std::string prepare_model_folder(const BenchOptions& options, shardit::dist::World& world) {
  if (!options.model_dir.empty()) return options.model_dir;
  const nlohmann::json config = synthetic_config(options);
  const fs::path root = fs::path(options.cache_dir) /
                        ("flux1-width3072-d" + std::to_string(options.num_double) + "-s" +
                         std::to_string(options.num_single));
  const fs::path done_marker = root / ".complete";
  if (world.rank() == 0) {
    if (!fs::exists(done_marker)) {
      std::fprintf(stderr, "bench: writing synthetic checkpoint %s\n", root.string().c_str());
      fs::remove_all(root);
      write_synthetic_folder(root, config);
      std::ofstream(done_marker) << "ok\n";
    }
    for (int r = 1; r < world.size(); ++r) world.post("bench/synthetic-ready/" + std::to_string(r), root.string());
  } else {
    // Writing a full-depth checkpoint (24 GB) takes longer than a collective may wait: the
    // others look for rank 0's word in the store instead (an error if rank 0 is gone).
    while (!world.take("bench/synthetic-ready/" + std::to_string(world.rank()))) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  return root.string();
}

// ---------------------------------------------------------------------------------------------
// FLOPs and the GEMM rate

/// Multiply-add FLOPs (2 per MAC) of the matmuls of one FLUX.1 forward: every Linear plus the two
/// attention products. Element-wise work is not counted.
double flux_forward_flops(const FluxTransformer2DModelConfig& config, int64_t batch, int64_t image_tokens,
                          int64_t text_tokens) {
  const double d = static_cast<double>(config.inner_dim());
  const double n = static_cast<double>(image_tokens);
  const double l = static_cast<double>(text_tokens);
  const double s = n + l;
  const double mlp = 4.0 * d;
  // Per token. Double block, each stream with its own weights: q, k, v, out (4 d^2) and the MLP
  // (2 d mlp); single block: q, k, v (3 d^2), proj_mlp (d mlp), proj_out ((d + mlp) d). Both
  // attend over the joint sequence: q k^T and p v, s^2 d each.
  const double double_block = 2.0 * s * (4.0 * d * d + 2.0 * d * mlp) + 2.0 * 2.0 * s * s * d;
  const double single_block = 2.0 * s * (3.0 * d * d + d * mlp + (d + mlp) * d) + 2.0 * 2.0 * s * s * d;
  const double embed = 2.0 * (n * config.in_channels * d + l * config.joint_attention_dim * d) +
                       2.0 * n * d * config.patch_size * config.patch_size * config.resolved_out_channels();
  // Per sample: the AdaLN modulations (d -> 6d for each stream of a double block, d -> 3d per
  // single block, d -> 2d in norm_out) and the conditioning embedders (256 -> d -> d for the
  // timestep and the guidance, pooled -> d -> d for the text).
  const double modulation = 2.0 * d * d * (12.0 * config.num_layers + 3.0 * config.num_single_layers + 2.0);
  const double conditioning = 2.0 * ((256.0 * d + d * d) * (config.guidance_embeds ? 2.0 : 1.0) +
                                     config.pooled_projection_dim * d + d * d);
  return batch * (config.num_layers * double_block + config.num_single_layers * single_block + embed + modulation +
                  conditioning);
}

/// GFLOP/s of a product in `dtype` shaped like the model's projections ([B·S, D] x [D, D]) on the
/// kernel the model's Linears use for it (nn::linear: --gemm-backend), with this rank's threads:
/// the median of five after a warm-up. The operands are made once, so measuring again between
/// the timed steps allocates nothing new.
class GemmRateProbe {
 public:
  GemmRateProbe(int64_t rows, int64_t dim, at::ScalarType dtype)
      : a_(at::randn({rows, dim}).to(dtype)), b_(at::randn({dim, dim}).to(dtype)) {}
  double gflops() const {
    const double flop = 2.0 * a_.size(0) * a_.size(1) * b_.size(0);
    at::Tensor c = shardit::nn::linear(a_, b_);  // warm-up
    std::vector<double> rates;
    for (int i = 0; i < 5; ++i) {
      const auto start = Clock::now();
      c = shardit::nn::linear(a_, b_);
      rates.push_back(flop / seconds_since(start) / 1e9);
    }
    std::sort(rates.begin(), rates.end());
    return rates[rates.size() / 2];
  }

 private:
  at::Tensor a_, b_;
};

/// The GEMM kernel selection, what auto measured, and the BLAS library's own kernel choice.
nlohmann::json gemm_report() {
  const shardit::nn::GemmProbe probe = shardit::nn::gemm_probe();
  return {{"selection", shardit::nn::gemm_backend_name(shardit::nn::gemm_backend_selection())},
          {"large_fp32_products_on",
           shardit::nn::gemm_backend_name(shardit::nn::gemm_backend_for(at::kCPU, at::kFloat, 4096, 1 << 24))},
          {"large_bf16_linears_on",
           shardit::nn::linear_on_amx(at::kCPU, at::kBFloat16, 4096, 3072, 3072) ? "amx" : "at::linear"},
          {"bf16_attention_on", shardit::nn::cpu_bf16_attention_backend()},
          {"probe_blas_gflops", probe.blas_gflops},
          {"probe_onednn_gflops", probe.onednn_gflops},
          {"probe_threads", probe.threads},
          {"blas_core", shardit::nn::cpu::blas_core_name()},
          {"cpu_features", shardit::cpu_features().to_string()},
          {"cpu_isa", shardit::nn::cpu::cpu_isa_summary()},
          {"kernels", shardit::nn::gemm_kernel_summary()},
          {"fused_cpu_kernels", shardit::nn::cpu::fused_kernels_name()}};
}

// ---------------------------------------------------------------------------------------------
// The benchmarks

void emit(const BenchOptions& options, const nlohmann::json& result, const std::string& markdown_row) {
  std::printf("%s\n", result.dump(2).c_str());
  std::printf("\n%s\n", markdown_row.c_str());
  if (!options.json_out.empty()) std::ofstream(options.json_out) << result.dump(2) << "\n";
}

int run_forward(const BenchOptions& options) {
  auto& world = shardit::dist::World::init();
  // Checked before anything is loaded.
  AlternatedSetting alternated;
  if (!options.alternate.empty()) {
    if (!options.step_cache.empty() || options.profile || options.op_profile) {
      throw std::invalid_argument("--alternate times settings against each other: run it without --cache, --profile "
                                  "and --op-profile (profile one setting at a time)");
    }
    alternated = AlternatedSetting(options.alternate);
    const int rounds = options.repeats / static_cast<int>(alternated.values().size());
    if (rounds < 2) {
      throw std::invalid_argument("--alternate with " + std::to_string(alternated.values().size()) +
                                  " values needs --repeats of at least " +
                                  std::to_string(2 * alternated.values().size()) + " (two rounds), got " +
                                  std::to_string(options.repeats));
    }
  }
  const int cp = options.ulysses * options.ring;
  TORCH_CHECK(world.size() % cp == 0, "shardit-bench forward: ulysses x ring = ", cp, " does not divide the ",
              world.size(), " ranks");
  const int tp = world.size() / cp;
  // The shared mesh convention: ulysses x ring x tp, tp fastest.
  std::optional<shardit::dist::DeviceMesh> mesh;
  if (cp > 1) mesh.emplace(world, std::vector<std::pair<std::string, int>>{{"ulysses", options.ulysses}, {"ring", options.ring}, {"tp", tp}});
  const at::ScalarType dtype = shardit::parse_compute_dtype(options.dtype);
  const std::string folder_path = prepare_model_folder(options, world);
  const auto folder = shardit::io::open_component(folder_path, "transformer");
  auto module = shardit::models::create_transformer(folder);
  auto* model = dynamic_cast<FluxTransformer2DModel*>(module.get());
  TORCH_CHECK(model != nullptr, "shardit-bench forward: supports FluxTransformer2DModel, got ", module->type_name());
  const auto& config = model->config;

  // Every rank measures its GEMM rate at the same time, so the sum is the machine's rate with
  // this many ranks and threads each: in the dtype the forward computes in (the yardstick of
  // "of GEMM rate"), and in fp32 beside it.
  const int64_t image_tokens = static_cast<int64_t>(options.height / 16) * (options.width / 16);
  const int64_t probe_rows = options.batch * (image_tokens + options.text_tokens);
  const auto machine_gemm_gflops = [&](at::ScalarType product_dtype) {
    world.group()->barrier();
    at::Tensor sum = at::tensor({GemmRateProbe(probe_rows, config.inner_dim(), product_dtype).gflops()}, at::kDouble);
    world.group()->all_reduce(sum);
    return sum.item<double>();
  };
  const double gemm_machine_before_load = machine_gemm_gflops(dtype);
  const double gemm_machine_fp32 = dtype == at::kFloat ? gemm_machine_before_load : machine_gemm_gflops(at::kFloat);
  // bf16 on the AMX kernel: LibTorch's own bf16 product of the same shape (oneDNN's) beside it.
  const bool bf16_on_amx =
      dtype == at::kBFloat16 && shardit::nn::linear_on_amx(at::kCPU, dtype, probe_rows, config.inner_dim(), config.inner_dim());
  const double gemm_machine_at_linear = bf16_on_amx ? [&] {
    shardit::nn::GemmBackendGuard at_linear(shardit::nn::GemmBackend::Blas);  // bf16 Linears on at::linear
    return machine_gemm_gflops(dtype);
  }() : 0.0;

  const int64_t rss_before_load = current_rss_bytes();
  shardit::parallel::LoadOptions load;
  load.dtype = dtype;
  load.weights = shardit::nn::parse_weights_dtype(options.weights_dtype);
  load.int8_compute = options.int8_compute;
  if (mesh) {
    if (tp > 1) load.tensor_parallel = shardit::parallel::TensorParallelConfig(*mesh, "tp");
  } else if (tp > 1) {
    load.tensor_parallel = shardit::parallel::TensorParallelConfig::from_degree(world, tp);
  }
  model->load(folder.weights(), load);
  if (mesh) model->enable_context_parallelism(shardit::parallel::ContextParallelConfig(*mesh));
  // Every group the forward talks on: the world (barriers), and the mesh's tp, ulysses and ring.
  std::vector<shardit::dist::Group*> groups = {world.group().get()};
  if (mesh) {
    for (const auto& [name, size] : mesh->dims()) groups.push_back(mesh->group(name).get());
  } else if (load.tensor_parallel && load.tensor_parallel->group.get() != world.group().get()) {
    groups.push_back(load.tensor_parallel->group.get());
  }
  const int64_t parameter_bytes = model->parameter_bytes();

  // --lora-rank: two adapters read once and kept unfused (as `serve --lora` keeps them), then the
  // change of the active set between requests is timed; the forward below runs with both active.
  std::unique_ptr<shardit::parallel::LoraAdapters> adapters;
  nlohmann::json lora_result;
  if (options.lora_rank > 0) {
    std::vector<shardit::models::LoraRequest> requests = {{bench_adapter(options, config, 1, world), 0.8, ""},
                                                          {bench_adapter(options, config, 2, world), 0.5, ""}};
    adapters = std::make_unique<shardit::parallel::LoraAdapters>(*model);
    const auto load_start = Clock::now();
    shardit::models::load_lora_files(*adapters, shardit::models::open_lora_files(requests, *model), 1.0, false);
    const double load_seconds = seconds_since(load_start);
    const std::vector<std::string> names = adapters->names();
    const std::vector<std::pair<std::vector<std::string>, std::vector<double>>> sets = {
        {{}, {}}, {{names[0]}, {0.8}}, {{names[1]}, {1.0}}, {names, {0.8, 0.5}}};
    constexpr int kSwitches = 10000;
    const auto switch_start = Clock::now();
    for (int i = 0; i < kSwitches; ++i) adapters->set_adapters(sets[i % 4].first, sets[i % 4].second);
    const double switch_seconds = seconds_since(switch_start) / kSwitches;
    adapters->set_adapters(names, {0.8, 0.5});
    lora_result = {{"rank", options.lora_rank}, {"adapters", 2}, {"load_seconds", load_seconds},
                   {"switch_seconds", switch_seconds}};
    std::printf("LoRA: 2 adapters of rank %d read in %.3f s (this rank's slices); switching the active set takes "
                "%.2f us (mean of %d switches); the forward runs with both active\n",
                options.lora_rank, load_seconds, switch_seconds * 1e6, kSwitches);
  }

  // One all-reduce per rowwise layer: what the plan the model was loaded with implies, to compare
  // with what was counted.
  using shardit::parallel::ShardStyle;
  const int64_t expected_all_reduces =
      model->resolved_plan()->layers_with_style({ShardStyle::Rowwise, ShardStyle::PackedRowwise});

  // Inputs as the pipeline makes them (values random, shapes real).
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto randn = [&](std::vector<int64_t> shape) {
    return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kFloat)).to(dtype);
  };
  shardit::models::FluxTransformer2DModelInputs inputs;
  const int64_t b = options.batch;
  inputs.hidden_states = randn({b, image_tokens, config.in_channels});
  inputs.encoder_hidden_states = randn({b, options.text_tokens, config.joint_attention_dim});
  inputs.pooled_projections = randn({b, config.pooled_projection_dim});
  inputs.timestep = at::full({b}, 0.5, at::kFloat).to(dtype);
  if (config.guidance_embeds) inputs.guidance = at::full({b}, 3.5, at::kFloat).to(dtype);
  const int64_t grid_w = options.width / 16;
  const at::Tensor positions = at::arange(image_tokens, at::kLong);
  inputs.img_ids = at::stack({at::zeros({image_tokens}, at::kLong), positions.div(grid_w, "floor"),
                              positions.remainder(grid_w)}, 1).to(at::kFloat);
  inputs.txt_ids = at::zeros({options.text_tokens, 3}, at::kFloat);

  // The steps' own peak (activations over the loaded weights): the high-water mark is reset after
  // loading, so the load's transient copies do not hide it.
  const int64_t load_peak = peak_rss_bytes();
  const int64_t rss_before_steps = current_rss_bytes();
  const bool high_water_reset = reset_resident_high_water();
  const auto reset_stats = [&] {
    for (auto* group : groups) group->stats().reset();
  };
  // With a step cache, each step has its own timestep (1 -> 0 over warmup + repeats), so the
  // transformer's residuals change from step to step as in a denoising loop and the cache has
  // something to decide; the per-step decisions are recorded.
  const int total_steps = options.warmup + options.repeats;
  int step_index = 0;
  const auto next_timestep = [&] {
    if (options.step_cache.empty()) return;
    const double t = 1.0 - static_cast<double>(step_index++) / total_steps;
    inputs.timestep = at::full({b}, t, at::kFloat).to(dtype);
  };
  if (!options.step_cache.empty()) model->enable_cache(shardit::models::StepCacheConfig::parse(options.step_cache));
  const auto last_forward_computed = [&] {
    const auto* cache = model->step_cache();
    return cache == nullptr || cache->records().at(0).computed.back();
  };
  // Every value of an alternated setting gets its own warm-up steps.
  for (size_t value = 0; value < std::max<size_t>(1, alternated.values().size()); ++value) {
    if (alternated.active()) alternated.apply(value);
    for (int i = 0; i < options.warmup; ++i) {
      next_timestep();
      model->forward(inputs);
    }
  }
  world.group()->barrier();
  reset_stats();
  if (options.profile) {
    shardit::profile::enable(true);
    shardit::profile::reset();
  }
  std::optional<shardit_bench::OpProfile> op_profile;
  if (options.op_profile) op_profile.emplace();
  const int64_t faults_before = minor_page_faults();
  std::vector<double> step_seconds;
  std::vector<double> computed_seconds, skipped_seconds;
  // The machine's rate is measured again right before each timed step (every rank at once), so
  // the yardstick comes from the steps' own window: on a shared machine the rate drifts within a
  // run (1,400 to 2,000 GFLOP/s for the same bf16 product within minutes, measured), and steps
  // timed in a slow stretch against a probe from a fast one, or the reverse, say nothing about the
  // engine. Not while profiling: the probe's products would be counted as the forward's.
  const bool probe_between_steps = !options.profile && !options.op_profile;
  std::optional<GemmRateProbe> step_probe;
  if (probe_between_steps) step_probe.emplace(probe_rows, config.inner_dim(), dtype);
  std::vector<double> probe_at_step;  // this rank's rate before each step; summed over ranks below
  for (int i = 0; i < options.repeats; ++i) {
    next_timestep();
    // Before the probe: it measures the product on the kernels of the step it precedes.
    if (alternated.active()) alternated.apply(static_cast<size_t>(i) % alternated.values().size());
    if (step_probe) {
      world.group()->barrier();
      probe_at_step.push_back(step_probe->gflops());
    }
    world.group()->barrier();
    const auto start = Clock::now();
    at::Tensor sample = model->forward(inputs);
    step_seconds.push_back(seconds_since(start));
    (last_forward_computed() ? computed_seconds : skipped_seconds).push_back(step_seconds.back());
  }
  const double faults_per_step = static_cast<double>(minor_page_faults() - faults_before) / options.repeats;
  if (alternated.active()) alternated.apply(0);  // the report's settings are the row's
  shardit::profile::enable(false);
  if (op_profile) op_profile->stop();
  // The barriers between steps are collectives too; count only the forward's.
  const double steps = options.repeats;
  shardit::dist::CommStats stats;
  for (auto* group : groups) {
    const auto& counted = group->stats();
    stats.collectives += counted.collectives;
    stats.bytes_sent += counted.bytes_sent;
    for (const auto& [op, calls] : counted.calls_by_op) stats.calls_by_op[op] += calls;
  }
  const double barrier_calls = static_cast<double>(stats.calls_by_op["barrier"]);
  const double all_reduces = stats.calls_by_op["all_reduce"] / steps;
  const double all_gathers = stats.calls_by_op["all_gather"] / steps;
  const double all_to_alls = stats.calls_by_op["all_to_all"] / steps;
  const double ring_shifts = stats.calls_by_op["ring_shift"] / steps;
  const double collectives = (stats.collectives - barrier_calls) / steps;
  const double bytes_sent = stats.bytes_sent / steps;

  const int64_t step_peak_growth = high_water_reset ? resident_high_water_bytes() - rss_before_steps : -1;
  const auto median_of = [](std::vector<double> v) {
    if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // Alternated: each value's steps apart (whole rounds only), the first value's as the run's row.
  nlohmann::json alternated_result;
  std::string alternated_summary;
  if (alternated.active()) {
    const size_t k = alternated.values().size();
    const size_t rounds = step_seconds.size() / k;
    std::vector<std::vector<double>> by_value(k);
    for (size_t r = 0; r < rounds; ++r) {
      for (size_t v = 0; v < k; ++v) by_value[v].push_back(step_seconds[r * k + v]);
    }
    const double baseline = median_of(by_value[0]);
    nlohmann::json values = nlohmann::json::array();
    alternated_summary = "alternated " + alternated.name() + " over " + std::to_string(rounds) + " rounds:";
    for (size_t v = 0; v < k; ++v) {
      const double median_v = median_of(by_value[v]);
      size_t faster = 0;
      for (size_t r = 0; r < rounds; ++r) faster += by_value[v][r] < by_value[0][r] ? 1 : 0;
      values.push_back({{"value", alternated.values()[v]},
                        {"step_seconds", {{"median", median_v},
                                          {"min", *std::min_element(by_value[v].begin(), by_value[v].end())},
                                          {"max", *std::max_element(by_value[v].begin(), by_value[v].end())},
                                          {"all", by_value[v]}}},
                        {"median_over_first", median_v / baseline},
                        {"rounds_faster_than_first", faster}});
      char part[256];
      if (v == 0) {
        std::snprintf(part, sizeof(part), " %s %.3f s", alternated.values()[v].c_str(), median_v);
      } else {
        std::snprintf(part, sizeof(part), "; %s %.3f s (%.3fx, faster in %zu of %zu rounds)",
                      alternated.values()[v].c_str(), median_v, median_v / baseline, faster, rounds);
      }
      alternated_summary += part;
    }
    alternated_result = {{"setting", alternated.name()}, {"rounds", rounds}, {"values", values}};
    step_seconds = by_value[0];
    // The row's yardstick: the probes taken on the first value's kernels (same indices on every rank).
    std::vector<double> first_value_probes;
    for (size_t r = 0; r < rounds && r * k < probe_at_step.size(); ++r) first_value_probes.push_back(probe_at_step[r * k]);
    probe_at_step = first_value_probes;
  }
  std::vector<double> sorted = step_seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double flops = flux_forward_flops(config, b, image_tokens, options.text_tokens);
  const double achieved = flops / median / 1e9;
  // The yardstick: the median of the probes taken between the steps (the one before loading where
  // there are none), against the median step. Medians of both, over one window: a probe is short
  // (five products) and one taken in a dip would make a step paired with it look faster than the
  // machine, so steps and probes are not paired one to one.
  double gemm_machine = gemm_machine_before_load;
  std::vector<double> probe_sums;
  if (!probe_at_step.empty()) {
    at::Tensor sums = at::tensor(probe_at_step, at::kDouble);
    world.group()->all_reduce(sums);
    probe_sums.assign(sums.data_ptr<double>(), sums.data_ptr<double>() + sums.numel());
    std::vector<double> sorted_probes = probe_sums;
    std::sort(sorted_probes.begin(), sorted_probes.end());
    gemm_machine = sorted_probes[sorted_probes.size() / 2];
  }
  const double fraction_of_gemm = achieved / gemm_machine;

  // Per-rank memory, gathered on rank 0.
  at::Tensor memory = at::tensor({static_cast<double>(std::max(load_peak, peak_rss_bytes())),
                                  static_cast<double>(parameter_bytes)},
                                 at::kDouble).unsqueeze(0);
  memory = world.group()->all_gather(memory, 0);
  if (world.rank() != 0) return 0;

  nlohmann::json per_rank = nlohmann::json::array();
  for (int r = 0; r < world.size(); ++r) {
    per_rank.push_back({{"rank", r},
                        {"peak_rss_bytes", static_cast<int64_t>(memory[r][0].item<double>())},
                        {"parameter_bytes", static_cast<int64_t>(memory[r][1].item<double>())}});
  }
  nlohmann::json result = {
      {"benchmark", "forward"},
      {"label", options.label},
      {"model", folder_path},
      {"num_layers", config.num_layers},
      {"num_single_layers", config.num_single_layers},
      {"tp_degree", tp},
      {"ulysses_degree", options.ulysses},
      {"ring_degree", options.ring},
      {"threads_per_rank", at::get_num_threads()},
      {"dtype", options.dtype},
      {"weights_dtype", options.weights_dtype},
      {"int8_compute", options.int8_compute},
      {"batch", b},
      {"image_tokens", image_tokens},
      {"text_tokens", options.text_tokens},
      {"step_seconds", {{"median", median}, {"min", sorted.front()}, {"max", sorted.back()}, {"all", step_seconds}}},
      {"matmul_gflop_per_step", flops / 1e9},
      {"achieved_gflops", achieved},
      {"gemm_dtype", c10::toString(dtype)},
      {"gemm_gflops_machine", gemm_machine},
      {"gemm_gflops_machine_per_step", probe_sums},
      {"gemm_gflops_machine_before_load", gemm_machine_before_load},
      {"gemm_gflops_machine_fp32", gemm_machine_fp32},
      {"gemm_gflops_machine_at_linear", gemm_machine_at_linear},
      {"fraction_of_gemm_rate", fraction_of_gemm},
      {"collectives_per_step", collectives},
      {"all_reduces_per_step", all_reduces},
      {"all_reduces_expected_from_plan", expected_all_reduces},
      {"all_gathers_per_step", all_gathers},
      {"all_to_alls_per_step", all_to_alls},
      {"ring_shifts_per_step", ring_shifts},
      {"bytes_sent_per_rank_per_step", bytes_sent},
      {"rss_before_load_bytes", rss_before_load},
      {"step_peak_rss_growth_bytes", step_peak_growth},  // rank 0; -1: VmHWM could not be reset
      {"minor_page_faults_per_step", faults_per_step},    // rank 0: fresh pages the allocations touched
      {"per_rank", per_rank},
      {"attention_backend", shardit::nn::attention_backend_selection()},
      {"attention_dispatches", shardit::nn::attention_dispatch_counts()},
      {"gemm", gemm_report()},
  };
  if (!lora_result.is_null()) result["lora"] = lora_result;
  if (!alternated_result.is_null()) result["alternate"] = alternated_result;
  if (const auto* cache = model->step_cache()) {
    result["step_cache"] = {{"config", cache->config().to_string()},
                            {"computed_steps", computed_seconds.size()},
                            {"skipped_steps", skipped_seconds.size()},
                            {"computed_step_seconds_median", median_of(computed_seconds)},
                            {"skipped_step_seconds_median", median_of(skipped_seconds)},
                            {"state_bytes", cache->state_bytes()}};
    std::printf("step cache %s: %zu computed steps (median %.3f s), %zu skipped (median %.3f s), %s of state\n",
                cache->config().to_string().c_str(), computed_seconds.size(), median_of(computed_seconds),
                skipped_seconds.size(), median_of(skipped_seconds), shardit::human_bytes(cache->state_bytes()).c_str());
  }
  // The kernel of the model's [rows, inner] x [inner, inner] products (fp32: BLAS or oneDNN; bf16:
  // the AMX kernel or at::linear, which is oneDNN's for bf16).
  const int64_t model_rows = options.batch * (image_tokens + options.text_tokens);
  const std::string gemm_kernel =
      std::string(c10::toString(dtype)) + " on " +
      (dtype == at::kBFloat16
           ? std::string(shardit::nn::linear_on_amx(at::kCPU, dtype, model_rows, config.inner_dim(), config.inner_dim())
                             ? "amx"
                             : "at::linear")
           : std::string(shardit::nn::gemm_backend_name(
                 shardit::nn::gemm_backend_for(at::kCPU, dtype, model_rows, config.inner_dim() * config.inner_dim()))));
  char row[512];
  std::snprintf(row, sizeof(row),
                "| forward | %s | TP=%d U=%d R=%d x %d thr | %lld img + %d txt | %.2f s (%.2f–%.2f) | %.0f GFLOP/s | %.2f of %.0f (%s) "
                "| %.0f all-reduce (plan: %lld), %.1f MiB/rank | %s params, %s peak RSS (rank 0) |",
                (options.dtype + (options.weights_dtype == "checkpoint" ? "" : " weights " + options.weights_dtype) +
                 (options.int8_compute ? " int8-compute" : ""))
                    .c_str(),
                tp, options.ulysses, options.ring, at::get_num_threads(), static_cast<long long>(image_tokens), options.text_tokens, median, sorted.front(), sorted.back(), achieved, fraction_of_gemm,
                gemm_machine, gemm_kernel.c_str(), all_reduces, static_cast<long long>(expected_all_reduces), bytes_sent / (1 << 20),
                shardit::gib(parameter_bytes).c_str(), shardit::gib(std::max(load_peak, peak_rss_bytes())).c_str());
  emit(options, result, row);
  if (!alternated_summary.empty()) std::printf("%s (the row above: %s)\n", alternated_summary.c_str(),
                                               alternated.values()[0].c_str());
  if (options.profile) std::printf("\nprofile of rank 0 over %d steps:\n%s", options.repeats, shardit::profile::report().c_str());
  if (op_profile) std::printf("\noperators of rank 0, per forward:\n%s", op_profile->report(options.repeats).c_str());
  return 0;
}

/// One attention call at FLUX.1 widths (B = 1, 24 heads x 128, S tokens of joint self-attention):
/// median time and the growth of the peak resident set during the call over the inputs'.
int run_attention(const BenchOptions& options) {
  // One rank: the world sets its threads to the cores (LibTorch's own default may be fewer).
  shardit::dist::World::init();
  const at::ScalarType dtype = shardit::parse_compute_dtype(options.dtype);
  const int64_t s = options.attention_tokens, h = options.attention_heads, d = options.attention_head_dim;
  at::manual_seed(0);
  // [B, H, S, D] views of [B, S, H, D] tensors, as the transformers pass them.
  const auto heads_view = [&] { return at::randn({1, s, h, d}).to(dtype).transpose(1, 2); };
  const at::Tensor q = heads_view(), k = heads_view(), v = heads_view();
  // An extra untimed call under the operator profile: the allocator's exact high-water mark of
  // live bytes during the call (the returned output included), and the operators it ran.
  int64_t allocator_peak = 0;
  int64_t output_bytes = 0;
  std::string operators;
  {
    shardit_bench::OpProfile profile;
    const at::Tensor out = shardit::nn::scaled_dot_product_attention(q, k, v);
    profile.stop();
    allocator_peak = profile.peak_bytes();
    output_bytes = static_cast<int64_t>(out.numel() * out.element_size());
    operators = profile.report(1);
  }
  std::vector<double> step_seconds;
  int64_t peak_growth = 0;
  for (int i = 0; i < options.warmup + options.repeats; ++i) {
    reset_peak_rss();
    const int64_t before = vm_hwm_bytes();
    const auto start = Clock::now();
    at::Tensor out = shardit::nn::scaled_dot_product_attention(q, k, v);
    const double seconds = seconds_since(start);
    peak_growth = std::max(peak_growth, vm_hwm_bytes() - before);
    if (i >= options.warmup) step_seconds.push_back(seconds);
  }
  std::vector<double> sorted = step_seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const auto counts = shardit::nn::attention_dispatch_counts();
  const std::string ran = counts.empty() ? "none" : counts.begin()->first;
  nlohmann::json result = {{"benchmark", "attention"},
                           {"label", options.label},
                           {"attention_backend", options.attention_backend},
                           {"ran", ran},
                           {"dtype", options.dtype},
                           {"tokens", s},
                           {"heads", h},
                           {"head_dim", d},
                           {"threads", at::get_num_threads()},
                           {"step_seconds", {{"median", median}, {"min", sorted.front()}, {"max", sorted.back()}}},
                           {"peak_rss_growth_bytes", peak_growth},
                           {"allocator_peak_bytes", allocator_peak},
                           {"output_bytes", output_bytes}};
  char row[512];
  std::snprintf(row, sizeof(row),
                "| attention | %s | %s | %lld tokens x %lld heads x %lld | %.3f s (%.3f–%.3f) | %s peak RSS growth | "
                "%.1f MiB allocator peak (output %.1f MiB) |",
                ran.c_str(), options.dtype.c_str(), static_cast<long long>(s), static_cast<long long>(h),
                static_cast<long long>(d), median, sorted.front(), sorted.back(), shardit::gib(peak_growth).c_str(),
                static_cast<double>(allocator_peak) / (1 << 20), static_cast<double>(output_bytes) / (1 << 20));
  emit(options, result, row);
  if (options.op_profile) std::printf("\noperators of one call:\n%s", operators.c_str());
  return 0;
}

int run_load(const BenchOptions& options) {
  auto& world = shardit::dist::World::init();
  const int tp = world.size();
  const at::ScalarType dtype = shardit::parse_compute_dtype(options.dtype);
  const std::string folder_path = prepare_model_folder(options, world);
  const auto folder = shardit::io::open_component(folder_path, "transformer");
  auto model = shardit::models::create_transformer(folder);
  const auto plan = model->resolve(tp, dtype);
  const int64_t expected_bytes = plan.replicated_bytes() + plan.sharded_bytes() / tp;

  world.group()->barrier();
  const int64_t rss_before = current_rss_bytes();
  const auto checkpoint = folder.weights();
  const auto start = Clock::now();
  shardit::parallel::LoadOptions load;
  load.dtype = dtype;
  const bool shard_on_load = options.load_path == "shard-on-load";
  TORCH_CHECK(shard_on_load || options.load_path == "load-then-shard",
              "--path must be shard-on-load or load-then-shard, got '", options.load_path, "'");
  if (tp > 1 && shard_on_load) load.tensor_parallel = shardit::parallel::TensorParallelConfig::from_degree(world, tp);
  model->load(checkpoint, load);
  if (tp > 1 && !shard_on_load) {
    model->enable_parallelism(shardit::parallel::TensorParallelConfig::from_degree(world, tp));
  }
  const double load_seconds = seconds_since(start);
  const int64_t peak_growth = peak_rss_bytes() - rss_before;

  at::Tensor numbers = at::tensor({load_seconds, static_cast<double>(peak_growth),
                                   static_cast<double>(model->parameter_bytes()),
                                   static_cast<double>(checkpoint.stats().bytes_read.load())},
                                  at::kDouble).unsqueeze(0);
  numbers = world.group()->all_gather(numbers, 0);
  if (world.rank() != 0) return 0;
  nlohmann::json per_rank = nlohmann::json::array();
  double worst_growth = 0;
  double worst_seconds = 0;
  for (int r = 0; r < tp; ++r) {
    per_rank.push_back({{"rank", r},
                        {"load_seconds", numbers[r][0].item<double>()},
                        {"peak_rss_growth_bytes", static_cast<int64_t>(numbers[r][1].item<double>())},
                        {"parameter_bytes", static_cast<int64_t>(numbers[r][2].item<double>())},
                        {"checkpoint_bytes_read", static_cast<int64_t>(numbers[r][3].item<double>())}});
    worst_growth = std::max(worst_growth, numbers[r][1].item<double>());
    worst_seconds = std::max(worst_seconds, numbers[r][0].item<double>());
  }
  nlohmann::json result = {
      {"benchmark", "load"},
      {"label", options.label},
      {"model", folder_path},
      {"path", options.load_path},
      {"tp_degree", tp},
      {"dtype", options.dtype},
      {"expected_bytes_per_rank", expected_bytes},
      {"peak_rss_growth_over_expected", worst_growth / expected_bytes},
      {"per_rank", per_rank},
  };
  char row[512];
  std::snprintf(row, sizeof(row), "| load | %s | TP=%d | %s | %.1f s | %s peak RSS growth (max rank) | %s expected | %.2fx |",
                options.dtype.c_str(), tp, options.load_path.c_str(), worst_seconds,
                shardit::gib(static_cast<int64_t>(worst_growth)).c_str(), shardit::gib(expected_bytes).c_str(),
                worst_growth / expected_bytes);
  emit(options, result, row);
  return 0;
}

/// The config.json of a text encoder at its released widths (CLIP-L, T5-XXL, Qwen3-4B of FLUX.2
/// [klein] 4B, Qwen2.5-VL-7B of Qwen-Image) with `layers` layers.
nlohmann::json encoder_config(const std::string& encoder, int layers) {
  if (encoder == "clip") {
    return {{"architectures", {"CLIPTextModel"}}, {"vocab_size", 49408}, {"hidden_size", 768},
            {"intermediate_size", 3072}, {"num_hidden_layers", layers}, {"num_attention_heads", 12},
            {"max_position_embeddings", 77}, {"hidden_act", "quick_gelu"}, {"eos_token_id", 2}};
  }
  if (encoder == "t5") {
    return {{"architectures", {"T5EncoderModel"}}, {"vocab_size", 32128}, {"d_model", 4096}, {"d_kv", 64},
            {"d_ff", 10240}, {"num_layers", layers}, {"num_heads", 64}, {"feed_forward_proj", "gated-gelu"}};
  }
  if (encoder == "qwen3") {
    return {{"architectures", {"Qwen3ForCausalLM"}}, {"vocab_size", 151936}, {"hidden_size", 2560},
            {"intermediate_size", 9728}, {"num_hidden_layers", layers}, {"num_attention_heads", 32},
            {"num_key_value_heads", 8}, {"head_dim", 128}, {"rope_theta", 1000000.0}, {"tie_word_embeddings", true}};
  }
  TORCH_CHECK(encoder == "qwen2_5_vl", "--encoder must be clip, t5, qwen3 or qwen2_5_vl, got '", encoder, "'");
  return {{"architectures", {"Qwen2_5_VLForConditionalGeneration"}}, {"vocab_size", 152064}, {"hidden_size", 3584},
          {"intermediate_size", 18944}, {"num_hidden_layers", layers}, {"num_attention_heads", 28},
          {"num_key_value_heads", 4}, {"rope_theta", 1000000.0},
          {"rope_scaling", {{"type", "mrope"}, {"mrope_section", {16, 24, 24}}}}};
}

/// Forward latency and per-rank parameter bytes of a text encoder at real widths (random weights,
/// sharded in memory), on one prompt of --text-tokens tokens (CLIP: 77).
int run_encoder(const BenchOptions& options) {
  auto& world = shardit::dist::World::init();
  const int tp = world.size();
  const at::ScalarType dtype = shardit::parse_compute_dtype(options.dtype);
  shardit::io::ComponentFolder folder;
  folder.dir = "(synthetic " + options.encoder + ")";
  folder.name = "text_encoder";
  folder.config = encoder_config(options.encoder, options.encoder_layers);
  auto model = shardit::models::create_text_encoder(folder);
  shardit::nn::init_random(*model, 20261130, dtype);
  if (tp > 1) model->enable_parallelism(shardit::parallel::TensorParallelConfig::from_degree(world, tp));
  const int64_t parameter_bytes = model->parameter_bytes();
  const auto plan = tp > 1 ? *model->resolved_plan() : model->resolve(1, dtype);

  const int64_t tokens = options.encoder == "clip" ? 77 : options.text_tokens;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor ids = at::randint(1000, {options.batch, tokens}, generator, at::TensorOptions().dtype(at::kLong));
  const at::Tensor mask = at::ones({options.batch, tokens}, at::kLong);
  const auto step = [&] {
    if (auto* clip = dynamic_cast<shardit::models::CLIPTextModel*>(model.get())) return clip->forward(ids).pooler_output;
    if (auto* t5 = dynamic_cast<shardit::models::T5EncoderModel*>(model.get())) return t5->forward(ids);
    if (auto* qwen3 = dynamic_cast<shardit::models::Qwen3ForCausalLM*>(model.get())) {
      return qwen3->forward(ids, mask).last_hidden_state;
    }
    return dynamic_cast<shardit::models::Qwen2_5_VLForConditionalGeneration&>(*model).forward(ids, mask).last_hidden_state;
  };
  for (int i = 0; i < options.warmup; ++i) step();
  std::vector<double> step_seconds;
  for (int i = 0; i < options.repeats; ++i) {
    world.group()->barrier();
    const auto start = Clock::now();
    step();
    step_seconds.push_back(seconds_since(start));
  }
  std::vector<double> sorted = step_seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  at::Tensor bytes = at::tensor({static_cast<double>(parameter_bytes), static_cast<double>(peak_rss_bytes())}, at::kDouble)
                         .unsqueeze(0);
  bytes = world.group()->all_gather(bytes, 0);
  if (world.rank() != 0) return 0;
  nlohmann::json per_rank = nlohmann::json::array();
  for (int r = 0; r < tp; ++r) {
    per_rank.push_back({{"rank", r},
                        {"parameter_bytes", static_cast<int64_t>(bytes[r][0].item<double>())},
                        {"peak_rss_bytes", static_cast<int64_t>(bytes[r][1].item<double>())}});
  }
  const int64_t whole_bytes = plan.replicated_bytes() + plan.sharded_bytes();
  nlohmann::json result = {
      {"benchmark", "encoder"},
      {"label", options.label},
      {"encoder", model->type_name()},
      {"layers", options.encoder_layers},
      {"tp_degree", tp},
      {"threads_per_rank", at::get_num_threads()},
      {"dtype", options.dtype},
      {"batch", options.batch},
      {"tokens", tokens},
      {"step_seconds", {{"median", median}, {"min", sorted.front()}, {"max", sorted.back()}, {"all", step_seconds}}},
      {"whole_parameter_bytes", whole_bytes},
      {"per_rank", per_rank},
  };
  char row[512];
  std::snprintf(row, sizeof(row), "| encoder | %s (%d layers) | %s | TP=%d x %d thr | %lld tokens | %.3f s (%.3f–%.3f) | %s of %s |",
                model->type_name().c_str(), options.encoder_layers, options.dtype.c_str(), tp, at::get_num_threads(),
                static_cast<long long>(tokens), median, sorted.front(), sorted.back(),
                shardit::gib(parameter_bytes).c_str(), shardit::gib(whole_bytes).c_str());
  emit(options, result, row);
  return 0;
}

/// One Linear [tokens, in] x [out, in]^T + bias four ways, in one process: fp32 and bf16 dense
/// weights, int8 weights dequantized to fp32 for the product (--weights-dtype int8), int8 compute
/// (--int8-compute). Median time, GFLOP/s, and the error against the fp64 product of the fp32
/// input and weight (max |y - y64| / max |y64|).
int run_gemm(const BenchOptions& options) {
  shardit::dist::World::init();  // threads: the cores
  const int64_t t = options.gemm_tokens, in = options.gemm_in, out = options.gemm_out;
  at::manual_seed(0);
  const at::Tensor x = at::randn({t, in});
  const at::Tensor weight = at::randn({out, in}) / std::sqrt(static_cast<double>(in));
  const at::Tensor bias = at::randn({out}) * 0.1;
  const at::Tensor exact = at::linear(x.to(at::kDouble), weight.to(at::kDouble), bias.to(at::kDouble));
  const double scale = exact.abs().max().item<double>();
  const auto make_linear = [&](at::ScalarType dtype, bool int8, bool int8_compute) {
    auto linear = std::make_shared<shardit::nn::Linear>(shardit::nn::LinearOptions(in, out));
    linear->weight = weight.to(dtype);
    linear->bias = bias.to(dtype);
    if (int8) {
      const at::Tensor row_scale = shardit::nn::symmetric_row_scales(weight.abs().amax(1), shardit::nn::WeightFormat::Int8);
      linear->set_quantized_weight(shardit::nn::quantize_rows(weight, shardit::nn::WeightFormat::Int8, row_scale),
                                   shardit::nn::WeightFormat::Int8, row_scale, dtype);
      if (int8_compute) linear->enable_int8_compute();
    }
    return linear;
  };
  struct Variant {
    const char* name;
    at::ScalarType dtype;
    bool int8;
    bool int8_compute;
  };
  const Variant variants[] = {{"f32", at::kFloat, false, false},
                              {"bf16", at::kBFloat16, false, false},
                              {"f32 weights int8", at::kFloat, true, false},
                              {"f32 weights int8 int8-compute", at::kFloat, true, true}};
  const double gflop = 2.0 * t * in * out / 1e9;
  nlohmann::json rows = nlohmann::json::array();
  std::string table;
  for (const Variant& variant : variants) {
    auto linear = make_linear(variant.dtype, variant.int8, variant.int8_compute);
    const at::Tensor input = x.to(variant.dtype);
    at::Tensor y = linear->forward(input);
    const double error = (y.to(at::kDouble) - exact).abs().max().item<double>() / scale;
    std::vector<double> seconds;
    for (int i = 0; i < options.warmup + options.repeats; ++i) {
      const auto start = Clock::now();
      y = linear->forward(input);
      if (i >= options.warmup) seconds.push_back(seconds_since(start));
    }
    std::sort(seconds.begin(), seconds.end());
    const double median = seconds[seconds.size() / 2];
    rows.push_back({{"variant", variant.name},
                    {"step_seconds", {{"median", median}, {"min", seconds.front()}, {"max", seconds.back()}}},
                    {"gflops", gflop / median},
                    {"max_error_of_max", error}});
    char row[256];
    std::snprintf(row, sizeof(row), "| gemm | %s | [%lld, %lld] x [%lld, %lld] x %d thr | %.1f ms (%.1f–%.1f) | %.0f GFLOP/s | %.1e |\n",
                  variant.name, static_cast<long long>(t), static_cast<long long>(in), static_cast<long long>(in),
                  static_cast<long long>(out), at::get_num_threads(), median * 1e3, seconds.front() * 1e3,
                  seconds.back() * 1e3, gflop / median, error);
    table += row;
  }
  const nlohmann::json result = {{"benchmark", "gemm"},
                                 {"label", options.label},
                                 {"tokens", t},
                                 {"in_features", in},
                                 {"out_features", out},
                                 {"threads", at::get_num_threads()},
                                 {"int8_engine", c10::toString(shardit::nn::int8_compute_engine())},
                                 {"int8_activation_code_max", shardit::nn::int8_activation_code_max()},
                                 {"variants", rows},
                                 {"gemm", gemm_report()}};
  table.pop_back();
  emit(options, result, table);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  shardit::nn::start_program(argv);
  CLI::App app{"shardit-bench: transformer forward and load benchmarks"};
  BenchOptions options;
  app.add_option("--nproc-per-node", options.nproc_per_node, "ranks on this host")->check(CLI::PositiveNumber);
  app.add_option("--model", options.model_dir, "a diffusers folder (default: a synthetic FLUX.1-dev-width one)");
  app.add_option("--cache-dir", options.cache_dir, "where the synthetic folder is written and reused");
  app.add_option("--double", options.num_double, "double-stream blocks of the synthetic model");
  app.add_option("--single", options.num_single, "single-stream blocks of the synthetic model");
  app.add_option("--dtype", options.dtype, "f32 or bf16");
  app.add_option("--json", options.json_out, "also write the result to this file");
  app.add_option("--label", options.label, "free text stored with the result");
  app.add_option("--attention-backend", options.attention_backend,
                 "auto, math, memory_efficient (sdpa where LibTorch has it)");
  app.add_option("--gemm-backend", options.gemm_backend,
                 "auto, blas, onednn or amx (CPU products: fp32 on BLAS or oneDNN, bf16 Linears on AMX)");
  auto* forward = app.add_subcommand("forward", "forward-step latency, memory, communication, roofline ratio");
  forward->add_option("--height", options.height, "image height in pixels (16 px per latent token)");
  forward->add_option("--width", options.width, "image width in pixels");
  forward->add_option("--text-tokens", options.text_tokens, "text sequence length");
  forward->add_option("--weights-dtype", options.weights_dtype,
                      "the Linear weights in memory: checkpoint, fp8 or int8 (docs/quantization.md)")
      ->check(CLI::IsMember({"checkpoint", "fp8", "int8"}));
  forward->add_flag("--int8-compute", options.int8_compute,
                    "with --weights-dtype int8: multiply in int8 (LibTorch's quantized engine, per-token activation "
                    "scales)");
  forward->add_option("--batch", options.batch, "batch size");
  forward->add_option("--warmup", options.warmup, "untimed steps first");
  forward->add_option("--repeats", options.repeats, "timed steps");
  forward->add_option("--ulysses", options.ulysses, "Ulysses (all-to-all) context-parallel degree")
      ->check(CLI::PositiveNumber);
  forward->add_option("--ring", options.ring, "ring-attention context-parallel degree")->check(CLI::PositiveNumber);
  forward->add_option("--cache", options.step_cache,
                      "a step cache (first_block_cache:threshold=..., taylorseer_lite:...): each step gets its own "
                      "timestep, and computed and skipped steps are timed apart");
  forward->add_option("--lora-rank", options.lora_rank,
                      "two LoRA adapters of this rank on every attention projection, unfused and both active; also "
                      "times switching the active set (0: none)")
      ->check(CLI::NonNegativeNumber);
  forward->add_option("--alternate", options.alternate,
                      "SETTING=A,B,...: the timed steps take the values in turn, each reported apart (settings: "
                      "fused-kernels, gemm-backend, attention-backend); the way to compare them on a drifting machine");
  forward->add_flag("--profile", options.profile, "print the time per profiling scope (layers, collectives)");
  forward->add_flag("--op-profile", options.op_profile,
                    "print every LibTorch operator per forward: calls, self time, allocations (as torch.profiler)");
  auto* load = app.add_subcommand("load", "load time and peak RSS per rank of a tensor-parallel load path");
  load->add_option("--path", options.load_path, "shard-on-load or load-then-shard");
  auto* encoder = app.add_subcommand("encoder", "text-encoder forward latency and parameter bytes per rank");
  encoder->add_option("--encoder", options.encoder, "clip, t5, qwen3 or qwen2_5_vl (real widths)");
  encoder->add_option("--layers", options.encoder_layers, "layers of the synthetic encoder")->check(CLI::PositiveNumber);
  encoder->add_option("--text-tokens", options.text_tokens, "prompt tokens (CLIP: always 77)");
  encoder->add_option("--batch", options.batch, "batch size");
  encoder->add_option("--warmup", options.warmup, "untimed steps first");
  encoder->add_option("--repeats", options.repeats, "timed steps");
  auto* attention = app.add_subcommand("attention", "one attention call: time and peak memory of a backend");
  attention->add_option("--tokens", options.attention_tokens, "sequence length (queries = keys)");
  attention->add_option("--heads", options.attention_heads, "heads");
  attention->add_option("--head-dim", options.attention_head_dim, "head dimension");
  attention->add_option("--warmup", options.warmup, "untimed calls first");
  attention->add_option("--repeats", options.repeats, "timed calls");
  attention->add_flag("--op-profile", options.op_profile, "print the operators of one call");
  auto* gemm = app.add_subcommand("gemm", "one Linear: fp32, bf16, int8 weights dequantized, int8 compute");
  gemm->add_option("--tokens", options.gemm_tokens, "rows of the input")->check(CLI::PositiveNumber);
  gemm->add_option("--in", options.gemm_in, "input features")->check(CLI::PositiveNumber);
  gemm->add_option("--out", options.gemm_out, "output features")->check(CLI::PositiveNumber);
  gemm->add_option("--warmup", options.warmup, "untimed calls first");
  gemm->add_option("--repeats", options.repeats, "timed calls");
  app.require_subcommand(1);
  // Common options may also follow the subcommand.
  forward->fallthrough();
  load->fallthrough();
  encoder->fallthrough();
  attention->fallthrough();
  gemm->fallthrough();
  CLI11_PARSE(app, argc, argv);
  options.mode = forward->parsed()     ? "forward"
                 : encoder->parsed()   ? "encoder"
                 : attention->parsed() ? "attention"
                 : gemm->parsed()      ? "gemm"
                                       : "load";

  if (options.nproc_per_node > 1) {
    return shardit::dist::relaunch_as_local_ranks(argc, argv, options.nproc_per_node);
  }
  try {
    shardit::nn::set_attention_backend(options.attention_backend);
    shardit::nn::set_gemm_backend(shardit::nn::parse_gemm_backend(options.gemm_backend));
    if (options.mode == "encoder") return run_encoder(options);
    if (options.mode == "attention") return run_attention(options);
    if (options.mode == "gemm") return run_gemm(options);
    return options.mode == "forward" ? run_forward(options) : run_load(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardit-bench: error: %s\n", shardit::error_message(e).c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
}
