// The program every example is (tp_example.h).
#include "tp_example.h"

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "shardit/core/error.h"
#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/nn/program_start.h"
#include "shardit/io/png.h"
#include "shardit/io/safetensors.h"
#include "shardit/nn/gemm.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/pipelines/pipeline.h"

namespace shardit::examples {

int run_tp_example(int argc, char** argv, const TpExample& example) {
  nn::start_program(argv);
  CLI::App app{example.description};
  std::string model, embeds, latents, out = example.out;
  // Unset: the pipeline's defaults (diffusers' __call__ defaults).
  std::optional<int64_t> height, width, steps;
  std::optional<double> guidance, true_cfg_scale;
  bool enable_parallelism = false;
  app.add_option("--model", model, example.pipeline_class + " folder (diffusers layout)")->required();
  app.add_option("--prompt-embeds", embeds, example.prompt_embeds)->required();
  app.add_option("--latents", latents, "start from these latents instead of seed 0");
  app.add_option("--height", height);
  app.add_option("--width", width);
  app.add_option("--steps", steps);
  app.add_option("--guidance", guidance, "guidance_scale");
  app.add_option("--true-cfg-scale", true_cfg_scale, "true_cfg_scale (CFG with negative_prompt_embeds)");
  app.add_option("--out", out);
  app.add_flag("--enable-parallelism", enable_parallelism, "load whole, then shard in memory");
  CLI11_PARSE(app, argc, argv);
  try {
    // The launch environment, and the ranks laid out for tensor parallelism over all of them
    // (the CLI's --tp; no mesh on one rank).
    dist::World& world = dist::World::init();
    const parallel::ParallelLayout layout = parallel::ParallelDims{1, 1, 1, 0}.build(world);

    // The transformer sharded while loading (each rank reads only its slices); the VAE is
    // replicated and loaded by rank 0 only, which decodes.
    pipelines::PipelineLoadOptions options;
    options.device = world.device();
    if (!enable_parallelism) options.parallel = layout;
    const auto pipe = pipelines::DiffusionPipeline::open(model, options);
    TORCH_CHECK(pipe->class_name() == example.pipeline_class, model, "/model_index.json names a ",
                pipe->class_name(), "; ", example.program, " runs a ", example.pipeline_class);
    pipe->load();
    if (enable_parallelism && layout.mesh) pipe->transformer()->enable_parallelism(*layout.tensor_parallel());

    pipelines::GenerateRequest request;
    request.prompt_embeds = pipelines::read_prompt_embeds(embeds);
    request.negative_prompt_embeds = pipelines::read_prompt_embeds(embeds, "negative_");
    request.height = height;
    request.width = width;
    request.num_inference_steps = steps;
    request.guidance_scale = guidance;
    request.true_cfg_scale = true_cfg_scale;
    if (!latents.empty()) request.latents = io::SafetensorsFile::open(latents)->read("latents");
    // The library draws no progress: the caller shows it as it likes (here a line on a terminal).
    if (world.rank() == 0 && ::isatty(STDERR_FILENO) == 1) {
      request.on_progress = [](int64_t done, int64_t total) {
        std::fprintf(stderr, "\rstep %lld/%lld%s", static_cast<long long>(done), static_cast<long long>(total),
                     done == total ? "\n" : "");
      };
    }
    const pipelines::GenerateResult result = pipe->generate(request);

    if (world.rank() == 0) {
      for (const auto& path : io::save_images(result.image, out)) std::printf("wrote %s\n", path.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", example.program.c_str(), error_message(e).c_str());
    return 1;
  }
}

}  // namespace shardit::examples
