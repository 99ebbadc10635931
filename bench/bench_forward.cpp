// shardit-bench forward: the latency of a transformer forward on the mesh of --tp, --ulysses and
// --ring, its memory per rank and communication, and the fraction of the machine's measured GEMM
// rate it reaches; with --lora-rank, the cost of switching adapters; with --alternate, settings
// timed against each other step by step. See docs/benchmarks.md.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench_support.h"
#include "op_profile.h"
#include "shardit/core/device.h"
#include "shardit/core/dtype.h"
#include "shardit/core/profile.h"
#include "shardit/core/units.h"
#include "shardit/dist/mesh.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/lora_formats.h"
#include "shardit/models/registry.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/nn/cpu/fused.h"
#include "shardit/nn/gemm.h"
#include "shardit/parallel/lora.h"
#include "shardit/parallel/parallel_dims.h"

namespace shardit_bench {

namespace {

namespace fs = std::filesystem;
using shardit::models::FluxTransformer2DModel;
using shardit::models::FluxTransformer2DModelConfig;

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

// ---------------------------------------------------------------------------------------------
// The forward benchmark's steps

/// --alternate, checked before anything is loaded (inactive without one).
AlternatedSetting checked_alternation(const BenchOptions& options) {
  if (options.alternate.empty()) return {};
  if (!options.pipeline.cache.empty() || options.profile || options.op_profile) {
    throw std::invalid_argument("--alternate times settings against each other: run it without --cache, --profile "
                                "and --op-profile (profile one setting at a time)");
  }
  AlternatedSetting alternated(options.alternate);
  const int rounds = options.repeats / static_cast<int>(alternated.values().size());
  if (rounds < 2) {
    throw std::invalid_argument("--alternate with " + std::to_string(alternated.values().size()) +
                                " values needs --repeats of at least " +
                                std::to_string(2 * alternated.values().size()) + " (two rounds), got " +
                                std::to_string(options.repeats));
  }
  return alternated;
}

/// The transformer to time, on the mesh of the forward's flags (ParallelDims::build, as the CLI
/// lays out a pipeline's transformer).
struct BenchTransformer {
  shardit::parallel::ParallelLayout layout;
  at::ScalarType dtype = at::kFloat;
  std::string folder_path;
  shardit::io::ComponentFolder folder;
  std::shared_ptr<shardit::parallel::TensorParallelModule> module;
  FluxTransformer2DModel* model = nullptr;  ///< module, as the FLUX.1 transformer it must be
  /// Every group the forward talks on: the world (barriers), and the mesh's dimensions.
  std::vector<shardit::dist::Group*> groups;
  int64_t parameter_bytes = 0;
};

/// Lays out the ranks and opens the model (no weight read yet).
BenchTransformer open_transformer(const BenchOptions& options, shardit::dist::World& world) {
  BenchTransformer bench;
  bench.layout = options.pipeline.dims().build(world);  // wrong degrees fail here, naming the flags
  bench.dtype = shardit::parse_compute_dtype(options.pipeline.dtype);
  bench.folder_path = prepare_model_folder(options, world);
  bench.folder = shardit::io::open_component(bench.folder_path, "transformer");
  bench.module = shardit::models::create_transformer(bench.folder);
  bench.model = dynamic_cast<FluxTransformer2DModel*>(bench.module.get());
  TORCH_CHECK(bench.model != nullptr, "shardit-bench forward: supports FluxTransformer2DModel, got ",
              bench.module->type_name());
  return bench;
}

/// Reads this rank's weights: sharded over the mesh's tp dimension (when above 1), the sequence
/// split over its ulysses and ring dimensions (when their product is above 1).
void load_transformer(const BenchOptions& options, shardit::dist::World& world, BenchTransformer& bench) {
  const shardit::parallel::ParallelDims& dims = bench.layout.dims;
  shardit::parallel::LoadOptions load;
  load.dtype = bench.dtype;
  load.device = world.device();
  load.weights = shardit::nn::parse_weights_dtype(options.pipeline.weights_dtype);
  load.int8_compute = options.pipeline.int8_compute;
  if (dims.tp > 1) load.tensor_parallel = bench.layout.tensor_parallel();
  bench.model->load(bench.folder.weights(), load);
  if (dims.ulysses * dims.ring > 1) {
    bench.model->enable_context_parallelism(shardit::parallel::ContextParallelConfig(*bench.layout.mesh));
  }
  bench.groups = {world.group().get()};
  if (bench.layout.mesh) {
    for (const auto& [name, size] : bench.layout.mesh->dims()) bench.groups.push_back(bench.layout.mesh->group(name).get());
  }
  bench.parameter_bytes = bench.model->parameter_bytes();
}

/// The machine's GEMM rate before loading, every rank measuring at the same time, so the sum is
/// the machine's rate with this many ranks and threads each: in the dtype the forward computes in
/// (the yardstick of "of GEMM rate"), in fp32 beside it, and bf16 on LibTorch's own kernel (oneDNN's)
/// where the model's bf16 products run on the AMX kernel (0 otherwise).
struct MachineGemmRates {
  double before_load = 0;
  double fp32 = 0;
  double at_linear = 0;
};

MachineGemmRates measure_machine_gemm(shardit::dist::World& world, int64_t probe_rows, int64_t inner,
                                      at::ScalarType dtype) {
  const auto machine_gemm_gflops = [&](at::ScalarType product_dtype) {
    world.group()->barrier();
    at::Tensor sum =
        at::tensor({GemmRateProbe(probe_rows, inner, product_dtype, world.device()).gflops()}, at::kDouble);
    world.group()->all_reduce(sum);
    return sum.item<double>();
  };
  MachineGemmRates rates;
  rates.before_load = machine_gemm_gflops(dtype);
  rates.fp32 = dtype == at::kFloat ? rates.before_load : machine_gemm_gflops(at::kFloat);
  const bool bf16_on_amx =
      dtype == at::kBFloat16 && shardit::nn::linear_on_amx(at::kCPU, dtype, probe_rows, inner, inner);
  if (bf16_on_amx) {
    shardit::nn::GemmBackendGuard at_linear(shardit::nn::GemmBackend::Blas);  // bf16 Linears on at::linear
    rates.at_linear = machine_gemm_gflops(dtype);
  }
  return rates;
}

/// --lora-rank: two adapters read once and kept unfused (as `serve --lora` keeps them), then the
/// change of the active set between requests is timed; the forward runs with both active after.
/// The result's "lora" record (null without --lora-rank).
nlohmann::json time_lora_switching(const BenchOptions& options, shardit::dist::World& world, BenchTransformer& bench,
                                   std::unique_ptr<shardit::parallel::LoraAdapters>& adapters) {
  if (options.lora_rank <= 0) return nullptr;
  FluxTransformer2DModel& model = *bench.model;
  std::vector<shardit::models::LoraRequest> requests = {{bench_adapter(options, model.config, 1, world), 0.8, ""},
                                                        {bench_adapter(options, model.config, 2, world), 0.5, ""}};
  adapters = std::make_unique<shardit::parallel::LoraAdapters>(model);
  const auto load_start = Clock::now();
  shardit::models::load_lora_files(*adapters, shardit::models::open_lora_files(requests, model), 1.0, false);
  const double load_seconds = seconds_since(load_start);
  const std::vector<std::string> names = adapters->names();
  const std::vector<std::pair<std::vector<std::string>, std::vector<double>>> sets = {
      {{}, {}}, {{names[0]}, {0.8}}, {{names[1]}, {1.0}}, {names, {0.8, 0.5}}};
  constexpr int kSwitches = 10000;
  const auto switch_start = Clock::now();
  for (int i = 0; i < kSwitches; ++i) adapters->set_adapters(sets[i % 4].first, sets[i % 4].second);
  const double switch_seconds = seconds_since(switch_start) / kSwitches;
  adapters->set_adapters(names, {0.8, 0.5});
  std::printf("LoRA: 2 adapters of rank %d read in %.3f s (this rank's slices); switching the active set takes "
              "%.2f us (mean of %d switches); the forward runs with both active\n",
              options.lora_rank, load_seconds, switch_seconds * 1e6, kSwitches);
  return {{"rank", options.lora_rank}, {"adapters", 2}, {"load_seconds", load_seconds},
          {"switch_seconds", switch_seconds}};
}

/// Inputs as the pipeline makes them (values random, shapes real).
shardit::models::FluxTransformer2DModelInputs forward_inputs(const BenchOptions& options,
                                                             const FluxTransformer2DModelConfig& config,
                                                             at::ScalarType dtype) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto randn = [&](std::vector<int64_t> shape) {
    return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kFloat)).to(dtype);
  };
  const int64_t image_tokens = static_cast<int64_t>(options.height / 16) * (options.width / 16);
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
  return inputs;
}

/// What the timed steps measured on this rank.
struct TimedSteps {
  std::vector<double> step_seconds;
  std::vector<double> computed_seconds, skipped_seconds;  ///< with a step cache: steps run whole / skipped
  std::vector<double> probe_at_step;  ///< this rank's GEMM rate before each step; summed over ranks later
  double faults_per_step = 0;
  int64_t load_peak = 0;          ///< peak RSS after loading, before the steps
  int64_t step_peak_growth = -1;  ///< the steps' high-water mark over the RSS before them; -1: not resettable
  shardit::dist::CommStats stats;  ///< the forward's collectives (the barriers between steps included)
};

/// The warm-up steps (each value of an alternated setting its own), then the timed ones, with the
/// machine's GEMM rate measured right before each (not while profiling: the probe's products
/// would be counted as the forward's), the collectives counted and the step's peak memory.
TimedSteps run_timed_steps(const BenchOptions& options, shardit::dist::World& world, BenchTransformer& bench,
                           shardit::models::FluxTransformer2DModelInputs& inputs, AlternatedSetting& alternated,
                           std::optional<OpProfile>& op_profile, int64_t probe_rows) {
  FluxTransformer2DModel& model = *bench.model;
  TimedSteps timed;
  // The steps' own peak (activations over the loaded weights): the high-water mark is reset after
  // loading, so the load's transient copies do not hide it.
  timed.load_peak = peak_rss_bytes();
  const int64_t rss_before_steps = current_rss_bytes();
  const bool high_water_reset = reset_resident_high_water();
  // With a step cache, each step has its own timestep (1 -> 0 over warmup + repeats), so the
  // transformer's residuals change from step to step as in a denoising loop and the cache has
  // something to decide; the per-step decisions are recorded.
  const bool cached = !options.pipeline.cache.empty();
  const int total_steps = options.warmup + options.repeats;
  int step_index = 0;
  const auto next_timestep = [&] {
    if (!cached) return;
    const double t = 1.0 - static_cast<double>(step_index++) / total_steps;
    inputs.timestep = at::full({options.batch}, t, at::kFloat).to(bench.dtype);
  };
  if (cached) model.enable_cache(*options.pipeline.cache_config());
  const auto last_forward_computed = [&] {
    const auto* cache = model.step_cache();
    return cache == nullptr || cache->records().at(0).computed.back();
  };
  // Every value of an alternated setting gets its own warm-up steps.
  for (size_t value = 0; value < std::max<size_t>(1, alternated.values().size()); ++value) {
    if (alternated.active()) alternated.apply(value);
    for (int i = 0; i < options.warmup; ++i) {
      next_timestep();
      model.forward(inputs);
    }
  }
  world.group()->barrier();
  for (auto* group : bench.groups) group->stats().reset();
  if (options.profile) {
    shardit::profile::enable(true);
    shardit::profile::reset();
  }
  if (options.op_profile) op_profile.emplace();
  const int64_t faults_before = minor_page_faults();
  // The machine's rate is measured again right before each timed step (every rank at once), so
  // the yardstick comes from the steps' own window: on a shared machine the rate drifts within a
  // run (1,400 to 2,000 GFLOP/s for the same bf16 product within minutes, measured), and steps
  // timed in a slow stretch against a probe from a fast one, or the reverse, say nothing about the
  // engine.
  std::optional<GemmRateProbe> step_probe;
  if (!options.profile && !options.op_profile) {
    step_probe.emplace(probe_rows, model.config.inner_dim(), bench.dtype, world.device());
  }
  for (int i = 0; i < options.repeats; ++i) {
    next_timestep();
    // Before the probe: it measures the product on the kernels of the step it precedes.
    if (alternated.active()) alternated.apply(static_cast<size_t>(i) % alternated.values().size());
    if (step_probe) {
      world.group()->barrier();
      timed.probe_at_step.push_back(step_probe->gflops());
    }
    world.group()->barrier();
    const auto start = Clock::now();
    at::Tensor sample = model.forward(inputs);
    shardit::synchronize(world.device());  // a CUDA step has only been queued when forward returns
    timed.step_seconds.push_back(seconds_since(start));
    (last_forward_computed() ? timed.computed_seconds : timed.skipped_seconds).push_back(timed.step_seconds.back());
  }
  timed.faults_per_step = static_cast<double>(minor_page_faults() - faults_before) / options.repeats;
  if (alternated.active()) alternated.apply(0);  // the report's settings are the row's
  shardit::profile::enable(false);
  if (op_profile) op_profile->stop();
  for (auto* group : bench.groups) {
    const auto& counted = group->stats();
    timed.stats.collectives += counted.collectives;
    timed.stats.bytes_sent += counted.bytes_sent;
    for (const auto& [op, calls] : counted.calls_by_op) timed.stats.calls_by_op[op] += calls;
  }
  timed.step_peak_growth = high_water_reset ? resident_high_water_bytes() - rss_before_steps : -1;
  return timed;
}

/// With --alternate: each value's steps apart (whole rounds only); the first value's steps and
/// probes become the run's row. The result's "alternate" record (null without), and its summary
/// line in `summary`.
nlohmann::json split_alternated_steps(const AlternatedSetting& alternated, TimedSteps& timed, std::string& summary) {
  if (!alternated.active()) return nullptr;
  const size_t k = alternated.values().size();
  const size_t rounds = timed.step_seconds.size() / k;
  std::vector<std::vector<double>> by_value(k);
  for (size_t r = 0; r < rounds; ++r) {
    for (size_t v = 0; v < k; ++v) by_value[v].push_back(timed.step_seconds[r * k + v]);
  }
  const double baseline = median_of(by_value[0]);
  nlohmann::json values = nlohmann::json::array();
  summary = "alternated " + alternated.name() + " over " + std::to_string(rounds) + " rounds:";
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
    summary += part;
  }
  timed.step_seconds = by_value[0];
  // The row's yardstick: the probes taken on the first value's kernels (same indices on every rank).
  std::vector<double> first_value_probes;
  for (size_t r = 0; r < rounds && r * k < timed.probe_at_step.size(); ++r) {
    first_value_probes.push_back(timed.probe_at_step[r * k]);
  }
  timed.probe_at_step = first_value_probes;
  return {{"setting", alternated.name()}, {"rounds", rounds}, {"values", values}};
}

/// The yardstick: the median of the machine's rate (the ranks' probes summed) over the steps, or
/// the one before loading where there are none; the sums per step in `probe_sums`. Medians of
/// both, over one window: a probe is short (five products) and one taken in a dip would make a
/// step paired with it look faster than the machine, so steps and probes are not paired one to
/// one. Collective.
double machine_gemm_over_steps(shardit::dist::World& world, const TimedSteps& timed, double before_load,
                               std::vector<double>& probe_sums) {
  if (timed.probe_at_step.empty()) return before_load;
  at::Tensor sums = at::tensor(timed.probe_at_step, at::kDouble);
  world.group()->all_reduce(sums);
  probe_sums.assign(sums.data_ptr<double>(), sums.data_ptr<double>() + sums.numel());
  return median_of(probe_sums);
}

/// Rank 0's report: the JSON record and the Markdown row, then the profiles.
struct ForwardMeasurements {
  MachineGemmRates rates;
  int64_t rss_before_load = 0;
  int64_t expected_all_reduces = 0;
  nlohmann::json lora;       ///< null without --lora-rank
  nlohmann::json alternate;  ///< null without --alternate
  std::string alternated_summary;
  double gemm_machine = 0;
  std::vector<double> probe_sums;
  at::Tensor memory;  ///< per rank: peak RSS, parameter bytes
};

void report_forward(const BenchOptions& options, shardit::dist::World& world, const BenchTransformer& bench,
                    const TimedSteps& timed, const ForwardMeasurements& measured,
                    const AlternatedSetting& alternated, const std::optional<OpProfile>& op_profile) {
  const FluxTransformer2DModelConfig& config = bench.model->config;
  const shardit::parallel::ParallelDims& dims = bench.layout.dims;
  const at::ScalarType dtype = bench.dtype;
  const int64_t image_tokens = static_cast<int64_t>(options.height / 16) * (options.width / 16);
  std::vector<double> sorted = timed.step_seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double flops = flux_forward_flops(config, options.batch, image_tokens, options.text_tokens);
  const double achieved = flops / median / 1e9;
  const double fraction_of_gemm = achieved / measured.gemm_machine;
  // The barriers between steps are collectives too; count only the forward's.
  shardit::dist::CommStats stats = timed.stats;
  const double steps = options.repeats;
  const double barrier_calls = static_cast<double>(stats.calls_by_op["barrier"]);
  const double all_reduces = stats.calls_by_op["all_reduce"] / steps;
  const double bytes_sent = stats.bytes_sent / steps;

  nlohmann::json per_rank = nlohmann::json::array();
  for (int r = 0; r < world.size(); ++r) {
    per_rank.push_back({{"rank", r},
                        {"peak_rss_bytes", static_cast<int64_t>(measured.memory[r][0].item<double>())},
                        {"parameter_bytes", static_cast<int64_t>(measured.memory[r][1].item<double>())}});
  }
  nlohmann::json result = {
      {"benchmark", "forward"},
      {"label", options.label},
      {"model", bench.folder_path},
      {"num_layers", config.num_layers},
      {"num_single_layers", config.num_single_layers},
      {"tp_degree", dims.tp},
      {"ulysses_degree", dims.ulysses},
      {"ring_degree", dims.ring},
      {"threads_per_rank", at::get_num_threads()},
      {"device", c10::str(world.device())},
      {"dtype", options.pipeline.dtype},
      {"weights_dtype", options.pipeline.weights_dtype},
      {"int8_compute", options.pipeline.int8_compute},
      {"batch", options.batch},
      {"image_tokens", image_tokens},
      {"text_tokens", options.text_tokens},
      {"step_seconds", {{"median", median}, {"min", sorted.front()}, {"max", sorted.back()}, {"all", timed.step_seconds}}},
      {"matmul_gflop_per_step", flops / 1e9},
      {"achieved_gflops", achieved},
      {"gemm_dtype", c10::toString(dtype)},
      {"gemm_gflops_machine", measured.gemm_machine},
      {"gemm_gflops_machine_per_step", measured.probe_sums},
      {"gemm_gflops_machine_before_load", measured.rates.before_load},
      {"gemm_gflops_machine_fp32", measured.rates.fp32},
      {"gemm_gflops_machine_at_linear", measured.rates.at_linear},
      {"fraction_of_gemm_rate", fraction_of_gemm},
      {"collectives_per_step", (stats.collectives - barrier_calls) / steps},
      {"all_reduces_per_step", all_reduces},
      {"all_reduces_expected_from_plan", measured.expected_all_reduces},
      {"all_gathers_per_step", stats.calls_by_op["all_gather"] / steps},
      {"all_to_alls_per_step", stats.calls_by_op["all_to_all"] / steps},
      {"ring_shifts_per_step", stats.calls_by_op["ring_shift"] / steps},
      {"bytes_sent_per_rank_per_step", bytes_sent},
      {"rss_before_load_bytes", measured.rss_before_load},
      {"step_peak_rss_growth_bytes", timed.step_peak_growth},  // rank 0; -1: VmHWM could not be reset
      {"minor_page_faults_per_step", timed.faults_per_step},    // rank 0: fresh pages the allocations touched
      {"per_rank", per_rank},
      {"attention_backend", shardit::nn::attention_backend_selection()},
      {"attention_dispatches", shardit::nn::attention_dispatch_counts()},
      {"gemm", gemm_report()},
  };
  if (!measured.lora.is_null()) result["lora"] = measured.lora;
  if (!measured.alternate.is_null()) result["alternate"] = measured.alternate;
  if (const auto* cache = bench.model->step_cache()) {
    result["step_cache"] = {{"config", cache->config().to_string()},
                            {"computed_steps", timed.computed_seconds.size()},
                            {"skipped_steps", timed.skipped_seconds.size()},
                            {"computed_step_seconds_median", median_of(timed.computed_seconds)},
                            {"skipped_step_seconds_median", median_of(timed.skipped_seconds)},
                            {"state_bytes", cache->state_bytes()}};
    std::printf("step cache %s: %zu computed steps (median %.3f s), %zu skipped (median %.3f s), %s of state\n",
                cache->config().to_string().c_str(), timed.computed_seconds.size(), median_of(timed.computed_seconds),
                timed.skipped_seconds.size(), median_of(timed.skipped_seconds),
                shardit::human_bytes(cache->state_bytes()).c_str());
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
  const std::string& weights_dtype = options.pipeline.weights_dtype;
  char row[512];
  std::snprintf(row, sizeof(row),
                "| forward | %s | TP=%d U=%d R=%d x %d thr | %lld img + %d txt | %.2f s (%.2f–%.2f) | %.0f GFLOP/s | %.2f of %.0f (%s) "
                "| %.0f all-reduce (plan: %lld), %.1f MiB/rank | %s params, %s peak RSS (rank 0) |",
                (options.pipeline.dtype + (weights_dtype == "checkpoint" ? "" : " weights " + weights_dtype) +
                 (options.pipeline.int8_compute ? " int8-compute" : ""))
                    .c_str(),
                dims.tp, dims.ulysses, dims.ring, at::get_num_threads(), static_cast<long long>(image_tokens),
                options.text_tokens, median, sorted.front(), sorted.back(), achieved, fraction_of_gemm,
                measured.gemm_machine, gemm_kernel.c_str(), all_reduces,
                static_cast<long long>(measured.expected_all_reduces), bytes_sent / (1 << 20),
                shardit::gib(bench.parameter_bytes).c_str(),
                shardit::gib(std::max(timed.load_peak, peak_rss_bytes())).c_str());
  emit(options, result, row);
  if (!measured.alternated_summary.empty()) {
    std::printf("%s (the row above: %s)\n", measured.alternated_summary.c_str(), alternated.values()[0].c_str());
  }
  if (options.profile) std::printf("\nprofile of rank 0 over %d steps:\n%s", options.repeats, shardit::profile::report().c_str());
  if (op_profile) std::printf("\noperators of rank 0, per forward:\n%s", op_profile->report(options.repeats).c_str());
}

}  // namespace

int run_forward(const BenchOptions& options) {
  auto& world = shardit::dist::World::init();
  AlternatedSetting alternated = checked_alternation(options);  // checked before anything is loaded
  BenchTransformer bench = open_transformer(options, world);
  const int64_t image_tokens = static_cast<int64_t>(options.height / 16) * (options.width / 16);
  const int64_t probe_rows = options.batch * (image_tokens + options.text_tokens);
  ForwardMeasurements measured;
  measured.rates = measure_machine_gemm(world, probe_rows, bench.model->config.inner_dim(), bench.dtype);
  measured.rss_before_load = current_rss_bytes();
  load_transformer(options, world, bench);
  std::unique_ptr<shardit::parallel::LoraAdapters> adapters;
  measured.lora = time_lora_switching(options, world, bench, adapters);
  // One all-reduce per rowwise layer: what the plan the model was loaded with implies, to compare
  // with what was counted.
  using shardit::parallel::ShardStyle;
  measured.expected_all_reduces =
      bench.model->resolved_plan()->layers_with_style({ShardStyle::Rowwise, ShardStyle::PackedRowwise});

  shardit::models::FluxTransformer2DModelInputs inputs = forward_inputs(options, bench.model->config, bench.dtype);
  std::optional<OpProfile> op_profile;
  TimedSteps timed = run_timed_steps(options, world, bench, inputs, alternated, op_profile, probe_rows);
  measured.alternate = split_alternated_steps(alternated, timed, measured.alternated_summary);
  measured.gemm_machine = machine_gemm_over_steps(world, timed, measured.rates.before_load, measured.probe_sums);
  // Per-rank memory, gathered on rank 0.
  measured.memory = at::tensor({static_cast<double>(std::max(timed.load_peak, peak_rss_bytes())),
                                static_cast<double>(bench.parameter_bytes)},
                               at::kDouble).unsqueeze(0);
  measured.memory = world.group()->all_gather(measured.memory, 0);
  if (world.rank() != 0) return 0;
  report_forward(options, world, bench, timed, measured, alternated, op_profile);
  return 0;
}

}  // namespace shardit_bench
