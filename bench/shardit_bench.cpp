// shardit-bench: forward latency, memory per rank, communication, and the fraction of the
// machine's measured GEMM rate that a transformer forward reaches; and load time / peak RSS of
// the two tensor-parallel load paths. See docs/benchmarks.md.
//
//   shardit-bench forward [--nproc-per-node N] [--dtype f32|bf16] [--height 512 --width 512]
//                         [--text-tokens 512] [--double 2 --single 4] [--model <folder>]
//                         [--ulysses U --ring R] [--tp T]  (the CLI's mesh: TP = N / (U x R) unless
//                                                           given; a smaller product runs replicas)
//                         [--lora-rank R]  (two unfused adapters, both active; times switching them)
//                         [--alternate SETTING=A,B]  (settings switched step by step, timed apart)
//   shardit-bench load    [--nproc-per-node N] --path shard-on-load|load-then-shard [...]
//   shardit-bench encoder [--nproc-per-node N] --encoder clip|t5|qwen3|qwen2_5_vl [--layers 2]
//                         [--text-tokens 512] [--dtype f32|bf16]
//   shardit-bench attention [--tokens 4608] [--heads 24] [--head-dim 128]  (one attention call)
//   shardit-bench gemm    [--tokens 1536 --in 3072 --out 3072]  (one Linear four ways)
//
// The options the CLI has too (--dtype; forward's --weights-dtype, --int8-compute, --tp, --ulysses,
// --ring and --cache; --attention-backend and --gemm-backend) are the CLI's own (apps/commands.h),
// read the same way.
//
// Without --model, forward and load build a synthetic diffusers folder with FLUX.1-dev widths
// (3072 hidden, 24 heads x 128, MLP x4, joint_attention_dim 4096) and random bf16 weights, in
// sharded safetensors with an index, and reuse it on later runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "bench_support.h"
#include "op_profile.h"
#include "shardit/core/dtype.h"
#include "shardit/core/error.h"
#include "shardit/core/units.h"
#include "shardit/dist/launcher.h"
#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/models/clip/modeling_clip.h"
#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/models/registry.h"
#include "shardit/models/t5/modeling_t5.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/nn/gemm.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/nn/program_start.h"
#include "shardit/parallel/parallel_dims.h"

namespace shardit_bench {

namespace {

/// One attention call at FLUX.1 widths (B = 1, 24 heads x 128, S tokens of joint self-attention):
/// median time and the growth of the peak resident set during the call over the inputs'.
int run_attention(const BenchOptions& options) {
  // One rank: the world sets its threads to the cores (LibTorch's own default may be fewer).
  shardit::dist::World::init();
  const at::ScalarType dtype = shardit::parse_compute_dtype(options.pipeline.dtype);
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
                           {"attention_backend", shardit::nn::attention_backend_selection()},
                           {"ran", ran},
                           {"dtype", options.pipeline.dtype},
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
                ran.c_str(), options.pipeline.dtype.c_str(), static_cast<long long>(s), static_cast<long long>(h),
                static_cast<long long>(d), median, sorted.front(), sorted.back(), shardit::gib(peak_growth).c_str(),
                static_cast<double>(allocator_peak) / (1 << 20), static_cast<double>(output_bytes) / (1 << 20));
  emit(options, result, row);
  if (options.op_profile) std::printf("\noperators of one call:\n%s", operators.c_str());
  return 0;
}

int run_load(const BenchOptions& options) {
  auto& world = shardit::dist::World::init();
  const int tp = world.size();
  const at::ScalarType dtype = shardit::parse_compute_dtype(options.pipeline.dtype);
  const std::string folder_path = prepare_model_folder(options, world);
  const auto folder = shardit::io::open_component(folder_path, "transformer");
  auto model = shardit::models::create_transformer(folder);
  // --transformer FILE: that file's weights (a single file or GGUF), counted as the load keeps them.
  const std::string& file = options.pipeline.transformer_file;
  const auto checkpoint =
      file.empty() ? folder.weights() : shardit::models::open_transformer_file(file, folder.class_name(), *model);
  const auto plan = file.empty() ? model->resolve(tp, dtype) : model->resolve_as_stored(checkpoint, tp, dtype);
  const int64_t expected_bytes = plan.replicated_bytes() + plan.sharded_bytes() / tp;

  world.group()->barrier();
  const int64_t rss_before = current_rss_bytes();
  const auto start = Clock::now();
  shardit::parallel::LoadOptions load;
  load.dtype = dtype;
  const bool shard_on_load = options.load_path == "shard-on-load";
  TORCH_CHECK(shard_on_load || options.load_path == "load-then-shard",
              "--path must be shard-on-load or load-then-shard, got '", options.load_path, "'");
  // TP over the whole world, laid out as the CLI lays out a model command's ranks.
  const auto world_tp = [&world] { return shardit::parallel::ParallelDims{1, 1, 1, 0}.build(world).tensor_parallel(); };
  if (tp > 1 && shard_on_load) load.tensor_parallel = world_tp();
  model->load(checkpoint, load);
  if (tp > 1 && !shard_on_load) model->enable_parallelism(world_tp().value());
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
      {"transformer_file", file},
      {"path", options.load_path},
      {"tp_degree", tp},
      {"dtype", options.pipeline.dtype},
      {"expected_bytes_per_rank", expected_bytes},
      {"peak_rss_growth_over_expected", worst_growth / expected_bytes},
      {"per_rank", per_rank},
  };
  char row[512];
  std::snprintf(row, sizeof(row), "| load | %s | TP=%d | %s | %.1f s | %s peak RSS growth (max rank) | %s expected | %.2fx |",
                options.pipeline.dtype.c_str(), tp, options.load_path.c_str(), worst_seconds,
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
  const at::ScalarType dtype = shardit::parse_compute_dtype(options.pipeline.dtype);
  shardit::io::ComponentFolder folder;
  folder.dir = "(synthetic " + options.encoder + ")";
  folder.name = "text_encoder";
  folder.config = encoder_config(options.encoder, options.encoder_layers);
  auto model = shardit::models::create_text_encoder(folder);
  shardit::nn::init_random(*model, 20261130, dtype);
  if (tp > 1) model->enable_parallelism(shardit::parallel::ParallelDims{1, 1, 1, 0}.build(world).tensor_parallel().value());
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
      {"dtype", options.pipeline.dtype},
      {"batch", options.batch},
      {"tokens", tokens},
      {"step_seconds", {{"median", median}, {"min", sorted.front()}, {"max", sorted.back()}, {"all", step_seconds}}},
      {"whole_parameter_bytes", whole_bytes},
      {"per_rank", per_rank},
  };
  char row[512];
  std::snprintf(row, sizeof(row), "| encoder | %s (%d layers) | %s | TP=%d x %d thr | %lld tokens | %.3f s (%.3f–%.3f) | %s of %s |",
                model->type_name().c_str(), options.encoder_layers, options.pipeline.dtype.c_str(), tp, at::get_num_threads(),
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

}  // namespace shardit_bench

int main(int argc, char** argv) {
  shardit::nn::start_program(argv);
  CLI::App app{"shardit-bench: transformer forward and load benchmarks"};
  shardit_bench::BenchOptions options;
  app.add_option("--nproc-per-node", options.nproc_per_node, "ranks on this host")->check(CLI::PositiveNumber);
  app.add_option("--model", options.model_dir, "a diffusers folder (default: a synthetic FLUX.1-dev-width one)");
  app.add_option("--cache-dir", options.cache_dir, "where the synthetic folder is written and reused");
  app.add_option("--double", options.num_double, "double-stream blocks of the synthetic model");
  app.add_option("--single", options.num_single, "single-stream blocks of the synthetic model");
  shardit::apps::add_dtype_option(&app, options.pipeline.dtype);
  app.add_option("--json", options.json_out, "also write the result to this file");
  app.add_option("--label", options.label, "free text stored with the result");
  shardit::apps::add_backend_options(&app, options.backends);
  auto* forward = app.add_subcommand("forward", "forward-step latency, memory, communication, roofline ratio");
  forward->add_option("--height", options.height, "image height in pixels (16 px per latent token)");
  forward->add_option("--width", options.width, "image width in pixels");
  forward->add_option("--text-tokens", options.text_tokens, "text sequence length");
  shardit::apps::add_weights_dtype_option(forward, options.pipeline.weights_dtype, options.pipeline.int8_compute);
  forward->add_option("--batch", options.batch, "batch size");
  forward->add_option("--warmup", options.warmup, "untimed steps first");
  forward->add_option("--repeats", options.repeats, "timed steps");
  shardit::apps::add_parallel_options(forward, options.pipeline);
  forward->remove_option(forward->get_option("--cfg-parallel"));  // one forward has no guidance branches to split
  shardit::apps::add_cache_option(forward, options.pipeline.cache);
  forward->get_option("--cache")->description(forward->get_option("--cache")->get_description() +
                                               "; each step gets its own timestep, and computed and skipped steps "
                                               "are timed apart");
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
  shardit::apps::add_transformer_file_option(load, options.pipeline.transformer_file);
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
    options.backends.apply();
    if (options.mode == "encoder") return shardit_bench::run_encoder(options);
    if (options.mode == "attention") return shardit_bench::run_attention(options);
    if (options.mode == "gemm") return shardit_bench::run_gemm(options);
    return options.mode == "forward" ? shardit_bench::run_forward(options) : shardit_bench::run_load(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardit-bench: error: %s\n", shardit::error_message(e).c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
}
