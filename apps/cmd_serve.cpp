// `shardit serve`: an OpenAI-compatible images API (POST /v1/images/generations, GET /v1/models,
// /health, /metrics) over a diffusers pipeline folder, loaded once and sharded over the ranks.
// Rank 0 answers HTTP; every rank computes.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <regex>
#include <string>

#include "apps/commands.h"
#include "shardit/core/dtype.h"
#include "shardit/core/heap.h"
#include "shardit/dist/world.h"
#include "shardit/io/image.h"
#include "shardit/io/json.h"
#include "shardit/models/builtin.h"
#include "shardit/serving/server.h"

namespace shardit::apps {

namespace {

namespace fs = std::filesystem;

struct ServeCommandOptions {
  std::string model;
  std::string model_name;
  serving::ServeOptions serve;
  PipelineCliOptions pipeline;
  int replicas = 0;  ///< 0: what the world leaves after cfg x ulysses x ring x tp
};

// `--lora NAME=FILE[:W]`: the name requests give in "lora"; without NAME= (or when the whole
// argument is an existing file, whose name may hold '='), the file's name without extension.
models::LoraRequest parse_named_lora(const std::string& argument) {
  static const std::regex name_re("^([A-Za-z0-9._-]{1,128})=(.+)$");
  std::smatch match;
  models::LoraRequest request;
  if (std::regex_match(argument, match, name_re) && !fs::exists(parse_lora_request(argument).path)) {
    request = parse_lora_request(match[2].str());
    request.name = match[1].str();
  } else {
    request = parse_lora_request(argument);
    request.name = models::lora_adapter_name(request.path);
  }
  return request;
}

int serve(ServeCommandOptions options) {
  dist::World& world = dist::World::get();
  serving::install_stop_handlers();
  serving::ServeOptions& serve = options.serve;
  if (options.model.empty()) {
    options.model = models::write_builtin_model(models::default_builtin_model_root()).pipeline;
    if (options.model_name.empty()) options.model_name = "shardit-builtin";
    if (world.rank() == 0) {
      fmt::print("(no --model given: serving the built-in tiny FLUX.1-architecture pipeline as \"{}\"; it draws "
                 "simple scenes such as \"a small red circle at the top left on a blue background\")\n",
                 options.model_name);
    }
  }
  serve.model_id = options.model_name.empty() ? model_folder_name(options.model) : options.model_name;
  if (!serve.output_dir.empty()) {
    TORCH_CHECK(fs::is_directory(serve.output_dir), "serve: --output-dir ", serve.output_dir,
                " is not a folder; create it first");
    serve.output_dir = fs::absolute(serve.output_dir).lexically_normal().string();
  }
  // Idle ranks hear from rank 0 at least every tick: well inside the collective timeout.
  serve.tick = std::min<std::chrono::milliseconds>(std::chrono::seconds(1), world.options().timeout / 4);
  const PipelineCliOptions& pipeline_options = options.pipeline;
  world.agree("serve arguments", fmt::format("{}|{}|{}|{}|{}", options.model, serve.limits.max_sequence_length,
                                            options.replicas, serve.max_batch, pipeline_options.agreement()));

  // --replicas R: the world as R copies of the mesh (ParallelDims::replicas; an unset --tp takes what they leave).
  auto load = pipeline_load_options(world, pipeline_options, options.replicas);
  // Each replica of the mesh serves requests of its own.
  load.independent_replicas = true;
  // The adapters, named for the requests to choose them by: the pipeline opens and checks them now,
  // before the long load, and loads them with its weights.
  load.lora.clear();
  for (const std::string& argument : pipeline_options.lora.files) {
    load.lora.push_back(parse_named_lora(argument));
    // A request's "model" names the base model or one adapter: the two must differ.
    TORCH_CHECK(load.lora.back().name != serve.model_id, "serve: --lora ", io::brief(nlohmann::json(argument)),
                ": the adapter's name ", io::quoted(serve.model_id),
                " is the served model's name, so \"model\" could not tell them apart; name it with --lora "
                "NAME=FILE, or the model with --model-name");
  }
  const auto pipeline = pipelines::DiffusionPipeline::open(options.model, load);
  serve.lora = load.lora;
  serve.lora_scale = pipeline_options.lora.scale;
  serve.fuse_lora = pipeline_options.lora.fuse;
  serve.limits.size_multiple = 2 * pipeline->vae_scale_factor();
  // Every request without a "cache" of its own gets --cache; checked against the model now.
  serve.limits.cache = pipeline_options.cache_config();
  if (serve.limits.cache) pipeline->joint_transformer().check_cache_config(*serve.limits.cache);

  serving::Server server(serve);
  const int port = server.listen();
  if (world.rank() == 0) {
    fmt::print("shardit serve: loading {} ({}) on {} rank(s); GET http://{}:{}/health answers 503 until ready\n",
               serve.model_id, pipeline->class_name(), world.size(), serve.host, port);
    std::fflush(stdout);
  }
  pipeline->load();
  const int code = server.run(*pipeline);
  if (world.rank() == 0) {
    fmt::print("shardit serve: stopped\n");
    std::fflush(stdout);
  }
  return code;
}

}  // namespace

void register_serve(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<ServeCommandOptions>();
  CLI::App* command =
      app.add_subcommand("serve", "an OpenAI-compatible images API (POST /v1/images/generations and /v1/images/edits) over a pipeline");
  command->add_option("--model", options->model,
                      "diffusers pipeline folder (model_index.json); default: the built-in tiny pipeline, trained to draw simple scenes");
  command->add_option("--model-name", options->model_name,
                      "the name clients give as `model` (default: the folder's name)");
  command->add_option("--host", options->serve.host, "address to listen on (default 127.0.0.1: this host only)");
  command->add_option("--port", options->serve.port, "port to listen on; 0: any free port (printed)")
      ->check(integer_in(0, 65535));
  command->add_option("--queue-depth", options->serve.queue_depth,
                      "generation requests that may wait behind the running one; more get 429")
      ->check(integer_in(1, 4096));
  command->add_option("--replicas", options->replicas,
                      "data-parallel replicas of the cfg x ulysses x ring x tp mesh, each serving requests of its "
                      "own (default: the ranks the mesh leaves; --tp unset: what the replicas leave)")
      ->check(integer_in(1, 4096));
  command->add_option("--max-batch", options->serve.max_batch,
                      "most images one generation runs for queued requests that differ only in prompt, seed and "
                      "response format (each still gets exactly its own image); 1: one request at a time")
      ->check(integer_in(1, 64));
  command->add_option_function<int64_t>(
             "--batch-wait-ms",
             [options](int64_t ms) { options->serve.batch_wait = std::chrono::milliseconds(ms); },
             "how long a request waits for compatible ones to join its batch while it has room (default 0: only "
             "those already queued)")
      ->check(integer_in(0, 1000));
  command->add_option("--output-dir", options->serve.output_dir,
                      "folder for response_format \"url\" (images served under /images/); default: url refused");
  command->add_option("--max-images", options->serve.limits.max_images, "largest `n` per request")
      ->check(integer_in(1, 64));
  command->add_option("--max-steps", options->serve.limits.max_steps, "largest num_inference_steps")
      ->check(integer_in(1, pipelines::kMaxInferenceSteps));
  command->add_option("--max-image-size", options->serve.limits.max_side, "largest width or height in pixels")
      ->check(integer_in(16, pipelines::kMaxImageSide));
  command->add_option("--max-sequence-length", options->serve.limits.max_sequence_length,
                      "prompt tokens kept (longer prompts are truncated)")
      ->check(integer_in(1, pipelines::kMaxSequenceLength));
  command->add_option("--max-connections", options->serve.http.max_connections,
                      "connections served at once (each on its own thread); one more is answered 503")
      ->check(integer_in(4, 4096));
  command->add_option("--max-connections-per-client", options->serve.http.max_connections_per_client,
                      "connections one client address may hold at once; one more is answered 503 (default 0: no "
                      "cap; behind a proxy every client has its address)")
      ->check(integer_in(0, 4096));
  command->add_option_function<double>(
             "--request-timeout",
             [options](double seconds) {
               options->serve.http.request_deadline =
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
             },
             "seconds a request's head and body may take to arrive (default 10); slower clients get 408")
      ->check(number_in(0.1, 3600.0));
  // Edits carry their images base64 in the body: a 1024x1024 photo is 2-4 MB of it.
  options->serve.http.max_body_bytes = size_t{16} << 20;
  command->add_option_function<int64_t>(
             "--max-body-mb",
             [options](int64_t megabytes) { options->serve.http.max_body_bytes = static_cast<size_t>(megabytes) << 20; },
             "largest request body in MiB (default 16; /v1/images/edits carries its images in it); larger get 413")
      ->check(integer_in(1, 1024));
  command->add_option_function<double>(
             "--generation-timeout",
             [options](double seconds) {
               options->serve.generation_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
             },
             "seconds from a generation request's arrival to its answer (queue wait included); a later one is "
             "cancelled at its next step boundary and answered 504 (default: no limit)")
      ->check(number_in(0.1, 86400.0));
  command->add_option("--max-image-pixels", options->serve.limits.max_image_pixels,
                      "most pixels (width x height, read from the header before decoding) one reference image of "
                      "/v1/images/edits may have (default 67108864 = 8192x8192)")
      ->check(integer_in(1, io::kMaxInputImageSide * io::kMaxInputImageSide));
  command->add_option("--max-request-pixels", options->serve.limits.max_request_pixels,
                      "most pixels the reference images of one request may have together (default 134217728 = "
                      "2 x 8192x8192)")
      ->check(integer_in(1, pipelines::kMaxReferenceImages * io::kMaxInputImageSide * io::kMaxInputImageSide));
  command->add_option_function<double>(
             "--decode-timeout",
             [options](double seconds) {
               options->serve.limits.decode_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
             },
             "seconds decoding one request's reference images may take (default 10); a slower decode is "
             "stopped and answered 400")
      ->check(number_in(0.001, 3600.0));
  add_pipeline_options(command, options->pipeline);
  command->get_option("--lora")->description(
      "LoRA adapter [NAME=]FILE[:WEIGHT], loaded once at start (repeatable; NAME defaults to the file's name): "
      "a request chooses adapters by NAME in \"lora\" and without one gets all of them at their weights");
  command->callback([&body, options] {
    // Before the ranks' threads start: every thread's blocks in the heap each request trims.
    share_one_heap_arena();
    body = [options] { return serve(*options); };
  });
}

}  // namespace shardit::apps
