#pragma once
// What shardit-bench's subcommands share: their options (the CLI's own option sets for the dtype,
// the mesh, the step cache and the backends, apps/commands.h), the clock, this process's memory
// counters, the synthetic FLUX.1-width checkpoint, the GEMM-rate probe and the report's output.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "shardit/dist/world.h"

namespace shardit_bench {

using Clock = std::chrono::steady_clock;

struct BenchOptions {
  std::string mode;  // forward | load | encoder | attention | gemm
  int nproc_per_node = 1;
  std::string model_dir;
  std::string cache_dir = (std::filesystem::temp_directory_path() / "shardit-bench").string();
  int num_double = 2;
  int num_single = 4;
  /// --dtype (every subcommand); forward's --weights-dtype, --int8-compute, mesh degrees (--tp,
  /// --ulysses, --ring) and --cache: the CLI's options, read as the CLI reads them.
  shardit::apps::PipelineCliOptions pipeline;
  /// --attention-backend and --gemm-backend, as on the CLI.
  shardit::apps::BackendCliOptions backends;
  int64_t gemm_tokens = 1536;  // gemm: rows of the input
  int64_t gemm_in = 3072;
  int64_t gemm_out = 3072;
  int height = 512;
  int width = 512;
  int text_tokens = 512;
  int batch = 1;
  int warmup = 1;
  int repeats = 3;
  std::string load_path = "shard-on-load";
  std::string json_out;
  std::string label;
  bool profile = false;
  bool op_profile = false;
  std::string encoder = "t5";
  int encoder_layers = 2;
  int attention_tokens = 4608;
  int attention_heads = 24;
  int attention_head_dim = 128;
  int lora_rank = 0;  // forward: two adapters of this rank, unfused and both active (0: none)
  std::string alternate;  // forward: SETTING=A,B,... switched step by step (AlternatedSetting)
};

double seconds_since(Clock::time_point start);
/// The median of `values` (the upper one of an even count); NaN when empty.
double median_of(std::vector<double> values);

/// Peak resident set of this process so far, in bytes.
int64_t peak_rss_bytes();
/// Peak resident set from /proc (VmHWM), which, unlike getrusage, reset_peak_rss() can reset.
int64_t vm_hwm_bytes();
/// Resets VmHWM to the current resident set (Linux 4.0+: "5" to clear_refs).
void reset_peak_rss();
/// Minor page faults of this process so far: every fresh page a new allocation touches (large
/// blocks come from mmap and go back to the kernel when freed, so each is faulted in again).
int64_t minor_page_faults();
/// Current resident set, in bytes.
int64_t current_rss_bytes();
/// The kernel's resident high-water mark (VmHWM), in bytes; -1 when it cannot be read.
int64_t resident_high_water_bytes();
/// Resets VmHWM to the current resident set (Linux clear_refs 5); false where not supported.
bool reset_resident_high_water();

/// The model folder to benchmark: --model, or the synthetic one (made by rank 0 if missing).
std::string prepare_model_folder(const BenchOptions& options, shardit::dist::World& world);

/// GFLOP/s of a product in `dtype` shaped like the model's projections ([B·S, D] x [D, D]) on the
/// kernel the model's Linears use for it (nn::linear: --gemm-backend), with this rank's threads:
/// the median of five after a warm-up, on `device` (each product waited for). The operands are
/// made once, so measuring again between the timed steps allocates nothing new.
class GemmRateProbe {
 public:
  GemmRateProbe(int64_t rows, int64_t dim, at::ScalarType dtype, at::Device device);
  double gflops() const;

 private:
  at::Tensor a_, b_;
  at::Device device_;
};

/// The GEMM kernel selection, what auto measured, and the BLAS library's own kernel choice.
nlohmann::json gemm_report();

/// Prints the result as JSON, with the build's facts under "build" (nn/build_info.h), and its Markdown
/// row (and writes the JSON to --json when given).
void emit(const BenchOptions& options, const nlohmann::json& result, const std::string& markdown_row);

/// The subcommands (bench/bench_forward.cpp: forward; bench/shardit_bench.cpp: the others).
int run_forward(const BenchOptions& options);

}  // namespace shardit_bench
