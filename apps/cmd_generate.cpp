// `shardit generate`: a pipeline from a diffusers folder (FluxPipeline, FluxKontextPipeline,
// Flux2KleinPipeline, Flux2Pipeline, QwenImagePipeline, the Qwen-Image edit pipelines) from a prompt, and reference images
// (--image) for the editing pipelines, to PNG files, the transformer on a cfg x ulysses x ring x
// tp mesh of the ranks.
// Only rank 0 decodes and writes.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "shardit/core/dtype.h"
#include "shardit/core/units.h"
#include "shardit/dist/world.h"
#include "shardit/io/file.h"
#include "shardit/io/image.h"
#include "shardit/io/png.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/nn/attention/bf16_kernels.h"
#include "shardit/nn/cpu/fused.h"
#include "shardit/nn/gemm.h"
#include "shardit/pipelines/pipeline.h"

namespace shardit::apps {

namespace {

/// One line on what a call's step cache did, for people: "step cache first_block_cache:threshold=0.12:
/// the whole stack ran in 7 of 10 (cond), 6 of 10 (uncond) steps; 7 of 20 transformer calls
/// skipped; 96 MiB of cache state per rank". Empty without a cache.
std::string cache_summary(const pipelines::GenerateResult& result) {
  if (!result.cache || !result.cache_computed.defined()) return "";
  const at::Tensor computed = result.cache_computed;  // [steps, contexts]
  const int64_t steps = computed.size(0);
  std::vector<std::string> per_context;
  for (int64_t c = 0; c < computed.size(1); ++c) {
    per_context.push_back(fmt::format("{} of {} ({})", computed.select(1, c).sum().item<int64_t>(), steps,
                                      result.cache_contexts.at(static_cast<size_t>(c))));
  }
  const int64_t calls = computed.numel();
  const int64_t skipped = calls - computed.sum().item<int64_t>();
  return fmt::format("step cache {}: the whole stack ran in {} steps; {} of {} transformer calls skipped; {} of cache "
                     "state per rank",
                     result.cache->to_string(), fmt::join(per_context, ", "), skipped, calls,
                     human_bytes(result.cache_state_bytes));
}

namespace fs = std::filesystem;

/// The prompt of the built-in pipeline when none is given (its vocabulary: tools/builtin_scenes.py).
constexpr const char* kBuiltinPrompt = "a large white square at the bottom on a green background";

struct GenerateOptions {
  std::string model;
  std::vector<std::string> prompt;
  std::string prompt_embeds;
  std::vector<std::string> negative_prompt;
  std::optional<int64_t> height;
  std::optional<int64_t> width;
  std::optional<int64_t> steps;
  std::optional<double> guidance;
  std::optional<double> true_cfg_scale;
  int64_t max_sequence_length = 512;
  int64_t num_images = 1;
  uint64_t seed = 0;
  std::string latents;
  std::string out = "out.png";
  std::string out_tensors;
  PipelineCliOptions pipeline;
  bool save_steps = false;
  std::string compare_to;
  std::vector<std::string> images;  ///< --image: reference images (FLUX.2, Kontext)
  std::optional<int64_t> max_area;
  bool no_auto_resize = false;
};

/// "step 3/28 | 1.24 s/it | ETA 31 s" on one terminal line, rewritten after every step (the
/// pipeline's on_progress); silent when stderr is not a terminal.
class ProgressBar {
 public:
  explicit ProgressBar(bool enabled) : enabled_(enabled && ::isatty(STDERR_FILENO) == 1) {}
  void update(int64_t done, int64_t total) {
    if (!enabled_) return;
    if (done == 0) {  // the loop starts: the time per step leaves out the prompt encoding before it
      start_ = std::chrono::steady_clock::now();
      return;
    }
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const double per_step = elapsed / static_cast<double>(done);
    std::fprintf(stderr, "\rstep %lld/%lld | %.2f s/it | ETA %.0f s   ", static_cast<long long>(done),
                 static_cast<long long>(total), per_step, per_step * static_cast<double>(total - done));
    if (done == total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  }

 private:
  bool enabled_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

/// Compares the first image with a PNG written before (another TP degree, another machine): the
/// same picture up to one 8-bit level, since values that differ by float rounding can round to
/// neighbouring levels.
void compare_with(const std::string& reference_path, const at::Tensor& image) {
  const at::Tensor reference = io::read_png(reference_path).to(at::kInt);
  const at::Tensor ours = io::to_uint8_pixels(image[0]).to(at::kInt);
  TORCH_CHECK(reference.sizes() == ours.sizes(), "--compare-to ", reference_path, ": the image is ",
              fmt::format("{}", fmt::join(reference.sizes(), "x")), ", this one ",
              fmt::format("{}", fmt::join(ours.sizes(), "x")));
  const at::Tensor difference = (ours - reference).abs();
  const int max_levels = difference.max().item<int>();
  const int64_t differing = difference.ne(0).sum().item<int64_t>();
  TORCH_CHECK(max_levels <= 1, "the image differs from ", reference_path, " by up to ", max_levels, " levels in ",
              differing, " of ", difference.numel(), " values");
  fmt::print("the image equals {} ({} of {} values differ, by one 8-bit level at most: float rounding)\n",
             reference_path, differing, difference.numel());
}

/// The request `options` describe, every input file read and checked (prompt embeddings, latents,
/// reference images).
pipelines::GenerateRequest request_of(const GenerateOptions& options) {
  pipelines::GenerateRequest request;
  request.prompt = options.prompt;
  request.negative_prompt = options.negative_prompt;
  request.height = options.height;
  request.width = options.width;
  request.num_inference_steps = options.steps;
  request.guidance_scale = options.guidance;
  request.true_cfg_scale = options.true_cfg_scale;
  request.num_images_per_prompt = options.num_images;
  request.max_sequence_length = options.max_sequence_length;
  request.seed = options.seed;
  request.cache = options.pipeline.cache_config();
  for (const std::string& path : options.images) request.image.push_back(io::read_image(path));
  request.max_area = options.max_area;
  request.auto_resize = !options.no_auto_resize;
  if (!options.prompt_embeds.empty()) {
    request.prompt_embeds = pipelines::read_prompt_embeds(options.prompt_embeds);
    TORCH_CHECK(request.prompt_embeds.has_value(), options.prompt_embeds, ": holds no 'prompt_embeds' tensor");
    request.negative_prompt_embeds = pipelines::read_prompt_embeds(options.prompt_embeds, "negative_");
  }
  if (!options.latents.empty()) {
    const auto file = io::SafetensorsFile::open(options.latents);
    TORCH_CHECK(file->contains("latents"), options.latents,
                ": holds no 'latents' tensor (tensors: ", fmt::format("{}", fmt::join(file->names(), ", ")), ")");
    request.latents = file->read("latents");
  }
  return request;
}

/// The PNGs' text chunks: the generation parameters as image tools read them ("parameters"), and
/// each on its own.
std::vector<std::pair<std::string, std::string>> png_text(const GenerateOptions& options,
                                                          const pipelines::GenerateResult& result,
                                                          const std::string& pipeline_class) {
  const std::string prompt_text = options.prompt.empty() ? "(prompt embeddings from " + options.prompt_embeds + ")"
                                                         : fmt::format("{}", fmt::join(options.prompt, " | "));
  const std::string seed_text =
      options.latents.empty() ? std::to_string(options.seed) : "(latents from " + options.latents + ")";
  const std::string model_name = model_folder_name(options.model);
  return {{"parameters",
           fmt::format("{}\nNegative prompt: {}\nSteps: {}, Seed: {}, Size: {}x{}, Guidance: {}, Model: {}, "
                       "Pipeline: {}",
                       prompt_text, fmt::join(options.negative_prompt, " | "), result.num_inference_steps, seed_text,
                       result.width, result.height, result.guidance, model_name, pipeline_class)},
          {"prompt", prompt_text},
          {"negative_prompt", fmt::format("{}", fmt::join(options.negative_prompt, " | "))},
          {"seed", seed_text},
          {"steps", std::to_string(result.num_inference_steps)},
          {"guidance", fmt::format("{}", result.guidance)},
          {"model", model_name},
          {"Software", "shardit"}};
}

int generate(const GenerateOptions& given) {
  dist::World& world = dist::World::get();
  GenerateOptions options = given;
  if (options.model.empty()) {
    const auto builtin = models::write_builtin_model(models::default_builtin_model_root());
    options.model = builtin.pipeline;
    if (options.prompt.empty() && options.prompt_embeds.empty()) options.prompt = {kBuiltinPrompt};
    if (world.rank() == 0) {
      fmt::print(
          "(no --model given: the built-in tiny FLUX.1-architecture pipeline, trained to draw shapes, colours, sizes, "
          "positions and backgrounds, e.g. \"two yellow stars\" or \"a small green square on the right\"{})\n",
          given.prompt.empty() && given.prompt_embeds.empty() ? fmt::format("; prompt: \"{}\"", kBuiltinPrompt) : "");
    }
  }
  parse_compute_dtype(options.pipeline.dtype);  // a wrong --dtype fails before anything is read

  // Everything the command reads or writes is checked before anything is loaded.
  pipelines::GenerateRequest request = request_of(options);
  std::vector<std::pair<std::string, at::Tensor>> step_latents;
  if (options.save_steps) {
    TORCH_CHECK(!options.out_tensors.empty(), "generate: --save-steps writes into --out-tensors; give that too");
    request.callback_on_step_end = [&step_latents](int64_t step, const at::Tensor& latents) {
      step_latents.emplace_back("step" + std::to_string(step) + ".latents", latents.to(at::kCPU, at::kFloat).clone());
    };
  }
  if (!options.compare_to.empty()) {
    const std::string problem = io::regular_file_problem(options.compare_to);
    TORCH_CHECK(problem.empty(), "--compare-to ", options.compare_to, ": ", problem);
    io::png_size(options.compare_to);  // a PNG within the bound, known before anything runs
  }
  pipelines::check_request(request);
  const int64_t num_prompts =
      request.prompt_embeds ? request.prompt_embeds->num_prompts() : static_cast<int64_t>(options.prompt.size());
  const std::vector<std::string> pngs = io::image_paths(options.out, num_prompts * options.num_images);
  if (world.rank() == 0) {
    // The model folder stands for every file under it (weights, configs, tokenizer files).
    std::vector<std::string> inputs = {options.model, options.prompt_embeds, options.latents, options.compare_to,
                                       options.pipeline.transformer_file};
    inputs.insert(inputs.end(), options.images.begin(), options.images.end());
    for (const models::LoraRequest& lora : lora_requests(options.pipeline.lora)) inputs.push_back(lora.path);
    for (const auto& png : pngs) io::check_output_path(png, inputs);
    if (!options.out_tensors.empty()) io::check_output_path(options.out_tensors, inputs);
  }
  world.agree("generate arguments",
              fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}", options.model, fmt::join(options.prompt, "\x1f"),
                          options.prompt_embeds, fmt::join(options.negative_prompt, "\x1f"),
                          options.height.value_or(-1), options.width.value_or(-1), options.steps.value_or(-1),
                          options.guidance.value_or(-1), options.true_cfg_scale.value_or(-1), options.num_images,
                          options.seed, options.latents, fmt::join(options.images, "\x1f"),
                          options.max_area.value_or(-1), options.no_auto_resize, options.pipeline.agreement()));

  pipelines::PipelineLoadOptions load = pipeline_load_options(world, options.pipeline);
  load.load_text_encoders = options.prompt_embeds.empty();

  // The request is checked against the components' configs before any weight is read.
  const auto pipeline = pipelines::DiffusionPipeline::open(options.model, load);
  pipeline->check(request);
  const auto load_start = std::chrono::steady_clock::now();
  pipeline->load();
  const auto start = std::chrono::steady_clock::now();
  ProgressBar progress(world.rank() == 0);
  request.on_progress = [&progress](int64_t done, int64_t total) { progress.update(done, total); };
  const pipelines::GenerateResult result = pipeline->generate(request);
  const auto end = std::chrono::steady_clock::now();

  if (world.rank() == 0) {
    io::save_images(result.image, options.out, png_text(options, result, pipeline->class_name()));
    if (!options.compare_to.empty()) compare_with(options.compare_to, result.image);
    if (!options.out_tensors.empty()) {
      std::vector<std::pair<std::string, at::Tensor>> tensors = {{"image", result.image}, {"latents", result.latents}};
      tensors.insert(tensors.end(), step_latents.begin(), step_latents.end());
      if (result.cache_computed.defined()) tensors.emplace_back("cache.computed", result.cache_computed);
      if (result.cache_ratio.defined()) tensors.emplace_back("cache.ratio", result.cache_ratio);
      io::save_safetensors(options.out_tensors, tensors);
    }
    if (result.cache) fmt::print(stderr, "{}\n", cache_summary(result));
    const auto seconds = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    const parallel::ParallelDims dims = pipeline->parallel_dims();
    fmt::print(
        "{} ({}, transformer tp {} of {} ranks, mesh {}): {} image(s) {}x{}, {} steps in {:.2f} s (load {:.2f} s) -> "
        "{}{}\n",
        pipeline->class_name(), options.pipeline.dtype, dims.tp, world.size(), dims.to_string(), pngs.size(), result.width,
        result.height, result.num_inference_steps, seconds(start, end), seconds(load_start, start),
        fmt::join(pngs, ", "), options.out_tensors.empty() ? "" : ", " + options.out_tensors);
    fmt::print("fp32 matrix products on {}; fp32 attention on {}; bf16 attention on {}; fused element-wise kernels: {}\n",
               nn::gemm_kernel_summary(), nn::cpu_attention_backend(at::kFloat), nn::cpu_bf16_attention_backend(),
               nn::cpu::fused_kernels_name());
  }
  return 0;
}

}  // namespace

void register_generate(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* command = app.add_subcommand("generate", "text to image with a diffusers pipeline folder, written as PNG");
  command->add_option("--model", options->model,
                      "diffusers pipeline folder (model_index.json); default: the built-in tiny pipeline, trained to draw simple scenes");
  command->add_option("--prompt", options->prompt,
                      fmt::format("prompt (repeat for a batch); with neither --model nor --prompt/--prompt-embeds: "
                                  "\"{}\"",
                                  kBuiltinPrompt));
  command->add_option("--prompt-embeds", options->prompt_embeds,
                      "safetensors with prompt_embeds (+ pooled_prompt_embeds, prompt_embeds_mask, negative_*) "
                      "instead of --prompt");
  command->add_option("--negative-prompt", options->negative_prompt, "negative prompt (one, or one per prompt)");
  command->add_option("--height", options->height, "image height in pixels (a multiple of 16)")
      ->check(integer_in(1, std::numeric_limits<int64_t>::max()));
  command->add_option("--width", options->width, "image width in pixels (a multiple of 16)")
      ->check(integer_in(1, std::numeric_limits<int64_t>::max()));
  command->add_option("--steps", options->steps, "num_inference_steps")->check(integer_in(1, std::numeric_limits<int64_t>::max()));
  command->add_option("--guidance", options->guidance,
                      "guidance_scale (FLUX.1, FLUX.2 dev: embedded; FLUX.2 klein: CFG)");
  command->add_option("--true-cfg-scale", options->true_cfg_scale, "true_cfg_scale (FLUX.1, Qwen-Image)");
  command->add_option("--max-sequence-length", options->max_sequence_length, "max_sequence_length")
      ->check(integer_in(1, std::numeric_limits<int64_t>::max()));
  command->add_option("--num-images", options->num_images, "num_images_per_prompt")->check(integer_in(1, std::numeric_limits<int64_t>::max()));
  command->add_option("--seed", options->seed, "seed of the CPU generator drawing the initial latents")
      ->check(unsigned_in(0, std::numeric_limits<uint64_t>::max()));
  command->add_option("--latents", options->latents, "safetensors holding `latents` (the pipeline's latents=)")
      ->excludes(command->get_option("--seed"));
  command->add_option("--out", options->out, "output PNG (out_0.png, out_1.png ... for several images)");
  command->add_option("--out-tensors", options->out_tensors,
                      "also write `image` (float32 [B, H, W, 3] in [0, 1]) and the final `latents` here");
  command->add_option("--image", options->images,
                      "a reference image (PNG or JPEG) to edit from; repeat for several (FLUX.2: up to 10, each "
                      "its own tokens; QwenImageEditPlusPipeline: up to 3, the output sized from the last; "
                      "FluxKontextPipeline, QwenImageEditPipeline: the image to edit)");
  command->add_option("--max-area", options->max_area,
                      "FluxKontextPipeline: the output's area in pixels (default 1048576 = 1024x1024, at most "
                      "4194304 = 2048x2048), the aspect of --height x --width kept; the Qwen-Image edit "
                      "pipelines: the area of the VAE's images and of the default output size (default 1048576)")
      ->check(integer_in(1, pipelines::kMaxArea));
  command
      ->add_flag("--no-auto-resize", options->no_auto_resize,
                 "FluxKontextPipeline: keep the input image's own size (floored to multiples of 16) instead of "
                 "the preferred Kontext resolution nearest in aspect (diffusers' _auto_resize=False); needs "
                 "--image")
      ->needs(command->get_option("--image"));
  add_pipeline_options(command, options->pipeline);
  command->add_flag("--save-steps", options->save_steps,
                    "also write the latents after every step (`step<K>.latents`) into --out-tensors");
  command->add_option("--compare-to", options->compare_to,
                      "a PNG from another run (e.g. another TP degree): fail unless the first image equals it "
                      "within one 8-bit level");
  command->callback([&body, options] { body = [options] { return generate(*options); }; });
}

}  // namespace shardit::apps
