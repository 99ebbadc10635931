// FLUX.1 [dev] / [schnell] text to image with the transformer split over every rank (tensor
// parallelism), as in diffusers' tensor-parallel examples. Launch one process per rank:
//   torchrun --nproc-per-node 2 flux_tp --model FLUX.1-dev --prompt-embeds embeds.safetensors --out flux.png
// (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Prompt embeddings are
// T5's `prompt_embeds` and CLIP's `pooled_prompt_embeds` in one safetensors file (with the
// negative prompt's `negative_*` and --true-cfg-scale > 1 for true CFG).
#include "tp_example.h"

int main(int argc, char** argv) {
  return shardit::examples::run_tp_example(argc, argv,
                                           {"flux_tp", "FluxPipeline", "FLUX.1 with a tensor-parallel transformer",
                                            "prompt_embeds + pooled_prompt_embeds (+ negative_*)", "flux.png"});
}
