// FLUX.2 [dev] text to image with the transformer split over every rank (tensor parallelism), as
// in diffusers' tensor-parallel examples. Launch one process per rank:
//   torchrun --nproc-per-node 4 flux2_dev_tp --model FLUX.2-dev --prompt-embeds embeds.safetensors --out dev.png
// (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Prompt embeddings are the
// Mistral-3 `prompt_embeds`; the guidance (--guidance, default 4) is embedded, there is no CFG.
#include "tp_example.h"

int main(int argc, char** argv) {
  return shardit::examples::run_tp_example(
      argc, argv,
      {"flux2_dev_tp", "Flux2Pipeline", "FLUX.2 dev with a tensor-parallel transformer", "prompt_embeds", "dev.png"});
}
