// Qwen-Image text to image with the transformer split over every rank (tensor
// parallelism), as in diffusers' tensor-parallel examples. Launch one process per rank:
//   torchrun --nproc-per-node 2 qwenimage_tp --model Qwen-Image --prompt-embeds embeds.safetensors --out qwen.png
// (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Prompt embeddings are
// Qwen2.5-VL's `prompt_embeds` (+ `prompt_embeds_mask`) and the negative prompt's (`negative_*`) for true CFG.
#include "tp_example.h"

int main(int argc, char** argv) {
  return shardit::examples::run_tp_example(argc, argv,
                                           {"qwenimage_tp", "QwenImagePipeline",
                                            "Qwen-Image with a tensor-parallel transformer",
                                            "prompt_embeds (+ mask, negative_*)", "qwen.png"});
}
