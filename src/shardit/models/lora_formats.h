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

/// Detects the format of the LoRA file `file` from its keys and converts it for `model` (a
/// FluxTransformer2DModel, Flux2TransformerModel or QwenImageTransformer2DModel, loaded or not).
/// Errors name the file and the key: an unknown format, a key that is not a LoRA tensor or names
/// no module of the model, a factor without its partner, a fused source whose rows do not match
/// the modules it splits into.
parallel::LoraAdapterSpec read_lora_spec(const io::SafetensorsFile& file, parallel::TensorParallelModule& model);
/// The same for the file at `path`.
parallel::LoraAdapterSpec read_lora_spec(const std::string& path, parallel::TensorParallelModule& model);

/// The adapter name of a LoRA file: its file name without the extension ("pixel.safetensors" ->
/// "pixel").
std::string lora_adapter_name(const std::string& path);

/// One adapter file at a weight (what `--lora FILE[:WEIGHT]` asks for).
struct LoraRequest {
  std::string path;
  double weight = 1.0;
  /// The adapter's name (what set_adapters and a served request choose it by); empty: the file's
  /// name, lora_adapter_name(path).
  std::string name;
};

/// An adapter file opened once and converted for a model, no weight read yet.
struct LoraFile {
  std::string name;  ///< lora_adapter_name(path)
  double weight = 1.0;
  std::shared_ptr<io::SafetensorsFile> file;
  parallel::LoraAdapterSpec spec;
};

/// Opens and converts every requested file for `model` (loaded or not), refusing two adapters of
/// the same name. Reads no weight: call it before loading the model to fail early.
std::vector<LoraFile> open_lora_files(const std::vector<LoraRequest>& requests, parallel::TensorParallelModule& model);

/// Loads `files` into `adapters` (whose model is loaded), then makes exactly them active at their
/// weights, in this order, under the runtime scale `lora_scale`; with `fuse`, merges them into the
/// weights at `lora_scale` instead (no unfused adapter is left).
void load_lora_files(parallel::LoraAdapters& adapters, const std::vector<LoraFile>& files, double lora_scale,
                     bool fuse);

}  // namespace shardit::models
