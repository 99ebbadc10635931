// Qwen-Image text to image with the transformer split over every rank (tensor
// parallelism), as in diffusers' tensor-parallel examples. Launch one process per rank:
//   torchrun --nproc-per-node 2 qwenimage_tp --model Qwen-Image --prompt-embeds embeds.safetensors --out qwen.png
// (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Prompt embeddings are
// Qwen2.5-VL's `prompt_embeds` (+ `prompt_embeds_mask`) and the negative prompt's (`negative_*`) for true CFG.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <optional>
#include <string>

#include "shardit/core/error.h"
#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/io/safetensors.h"
#include "shardit/pipelines/pipeline_qwenimage.h"

int main(int argc, char** argv) {
  CLI::App app{"Qwen-Image with a tensor-parallel transformer"};
  std::string model, embeds, latents, out = "qwen.png";
  int64_t height = 1024, width = 1024, steps = 50;
  double true_cfg_scale = 4.0;
  bool enable_parallelism = false;
  app.add_option("--model", model, "Qwen-Image pipeline folder")->required();
  app.add_option("--prompt-embeds", embeds, "prompt_embeds (+ mask, negative_*)")->required();
  app.add_option("--latents", latents, "start from these latents instead of seed 0");
  app.add_option("--height", height);
  app.add_option("--width", width);
  app.add_option("--steps", steps);
  app.add_option("--true-cfg-scale", true_cfg_scale);
  app.add_option("--out", out);
  app.add_flag("--enable-parallelism", enable_parallelism, "load whole, then shard in memory");
  CLI11_PARSE(app, argc, argv);
  try {
    // The launch environment, and a 1-D mesh over all ranks for the transformer.
    shardit::dist::World& world = shardit::dist::World::init();
    const shardit::parallel::TensorParallelConfig tp(shardit::dist::DeviceMesh::one_d(world, "tp"), "tp");

    // The transformer sharded while loading (each rank reads only its slices); the VAE is
    // replicated and loaded by rank 0 only, which decodes.
    shardit::pipelines::PipelineLoadOptions options;
    options.device = world.device();
    if (!enable_parallelism) options.parallel = shardit::parallel::ParallelLayout{{1, 1, 1, world.size()}, tp.mesh};
    shardit::pipelines::QwenImagePipeline pipe(shardit::io::ModelFolder::open(model), options);
    pipe.load();
    if (enable_parallelism) pipe.transformer()->enable_parallelism(tp);

    shardit::pipelines::GenerateRequest request;
    request.prompt_embeds = shardit::pipelines::read_prompt_embeds(embeds);
    request.negative_prompt_embeds = shardit::pipelines::read_prompt_embeds(embeds, "negative_");
    request.height = height;
    request.width = width;
    request.num_inference_steps = steps;
    request.true_cfg_scale = true_cfg_scale;
    if (!latents.empty()) request.latents = shardit::io::SafetensorsFile::open(latents)->read("latents");
    const shardit::pipelines::GenerateResult result = pipe.generate(request);

    if (world.rank() == 0) {
      for (const auto& path : shardit::pipelines::save_images(result.image, out))
        std::printf("wrote %s\n", path.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qwenimage_tp: %s\n", shardit::error_message(e).c_str());
    return 1;
  }
}
