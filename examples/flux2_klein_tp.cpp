// FLUX.2 [klein] text to image with the transformer split over every rank (tensor
// parallelism), as in diffusers' tensor-parallel examples. Launch one process per rank:
//   torchrun --nproc-per-node 2 flux2_klein_tp --model FLUX.2-klein --prompt-embeds embeds.safetensors --out klein.png
// (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Prompt embeddings are
// the Qwen3 `prompt_embeds` and, for CFG (--guidance > 1, not distilled), `negative_prompt_embeds` (of "").
#include "tp_example.h"

int main(int argc, char** argv) {
  return shardit::examples::run_tp_example(
      argc, argv,
      {"flux2_klein_tp", "Flux2KleinPipeline", "FLUX.2 klein with a tensor-parallel transformer",
       "prompt_embeds (+ negative_prompt_embeds)", "klein.png"});
}
