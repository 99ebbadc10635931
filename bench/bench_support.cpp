// What shardit-bench's subcommands share: the clock, memory counters, the synthetic checkpoint,
// the GEMM-rate probe, the report.
#include "bench_support.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <thread>

#include "shardit/core/cpu_features.h"
#include "shardit/core/device.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/nn/attention/bf16_kernels.h"
#include "shardit/nn/cpu/blas_core.h"
#include "shardit/nn/cpu/dispatch.h"
#include "shardit/nn/cpu/fused.h"
#include "shardit/nn/build_info.h"
#include "shardit/nn/gemm.h"

namespace shardit_bench {

namespace fs = std::filesystem;
using shardit::models::FluxTransformer2DModel;
using shardit::models::FluxTransformer2DModelConfig;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median_of(std::vector<double> values) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

int64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

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

void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

int64_t minor_page_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_minflt);
}

int64_t current_rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * sysconf(_SC_PAGESIZE);
}

int64_t resident_high_water_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

bool reset_resident_high_water() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return clear_refs.good();
}

// ---------------------------------------------------------------------------------------------
// The synthetic checkpoint folder

namespace {

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

}  // namespace

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
// The GEMM rate and the report

GemmRateProbe::GemmRateProbe(int64_t rows, int64_t dim, at::ScalarType dtype, at::Device device)
    : a_(at::randn({rows, dim}).to(device, dtype)), b_(at::randn({dim, dim}).to(device, dtype)), device_(device) {}

double GemmRateProbe::gflops() const {
  const double flop = 2.0 * a_.size(0) * a_.size(1) * b_.size(0);
  at::Tensor c = shardit::nn::linear(a_, b_);  // warm-up
  shardit::synchronize(device_);
  std::vector<double> rates;
  for (int i = 0; i < 5; ++i) {
    const auto start = Clock::now();
    c = shardit::nn::linear(a_, b_);
    shardit::synchronize(device_);
    rates.push_back(flop / seconds_since(start) / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

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

void emit(const BenchOptions& options, const nlohmann::json& result, const std::string& markdown_row) {
  // Every report says what computed it: `shardit version`'s facts.
  nlohmann::json report = result;
  report["build"] = shardit::nn::build_facts_json();
  std::printf("%s\n", report.dump(2).c_str());
  std::printf("\n%s\n", markdown_row.c_str());
  if (!options.json_out.empty()) std::ofstream(options.json_out) << report.dump(2) << "\n";
}

}  // namespace shardit_bench
