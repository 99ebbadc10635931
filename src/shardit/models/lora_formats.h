#pragma once
// LoRA files as users have them, converted to diffusers' module names the way diffusers'
// loaders/lora_conversion_utils.py does, without reading any weight: the result says which rows
// of which file tensor each targeted Linear gets, and with what scaling (parallel::LoraAdapterSpec).
//   diffusers/PEFT  transformer.<module>.lora_A/lora_B.weight, optional <module>.alpha, optional
//                   __metadata__ lora_adapter_metadata (lora_alpha, r, patterns)    every family
//   kohya           lora_unet_<name>.lora_down/lora_up.weight + .alpha             FLUX.1 (BFL names,
//                   fused qkv and linear1 split by rows), FLUX.2 (BFL names), Qwen-Image (diffusers
//                   names with `_`)
//   XLabs           double_blocks.<i>.processor.qkv_lora1.down/up.weight ...       FLUX.1
//   BFL/ai-toolkit  diffusion_model.<BFL module>.lora_A/lora_B.weight              FLUX.2 (and
//                   diffusion_model.<name> for FLUX.1 and Qwen-Image)
#include <memory>
#include <string>
#include <vector>

#include "shardit/parallel/lora.h"

namespace shardit::models {

/// Detects the format of the LoRA file at `path` from its keys and converts it for `model` (a
/// FluxTransformer2DModel, Flux2TransformerModel or QwenImageTransformer2DModel, loaded or not).
/// Errors name the file and the key: an unknown format, a key that is not a LoRA tensor or names
/// no module of the model, a factor without its partner, a fused source whose rows do not match
/// the modules it splits into.
parallel::LoraAdapterSpec read_lora_spec(const std::string& path, parallel::TensorParallelModule& model);

/// The adapter name of a LoRA file: its file name without the extension ("pixel.safetensors" ->
/// "pixel").
std::string lora_adapter_name(const std::string& path);

/// One `--lora FILE[:WEIGHT]` request.
struct LoraRequest {
  std::string path;
  double weight = 1.0;
};

/// Parses "FILE[:WEIGHT]": the part after the last ':' is the weight when it is a number (so a
/// path may hold ':'); without one, the weight is 1.
LoraRequest parse_lora_request(const std::string& argument);

/// Converts and loads every requested file into `model` (loaded already), each named after its
/// file, activates them at their weights in this order, and sets the runtime scale `lora_scale`;
/// with `fuse`, merges them into the weights at `lora_scale` instead (the result then holds no
/// unfused adapter). Every file is converted and checked before the first one is loaded.
std::unique_ptr<parallel::LoraAdapters> load_lora_requests(parallel::TensorParallelModule& model,
                                                           const std::vector<LoraRequest>& requests,
                                                           double lora_scale, bool fuse);

}  // namespace shardit::models
