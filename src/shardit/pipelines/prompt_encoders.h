#pragma once
// The PromptEncoders of the three pipeline families, built from a pipeline folder's tokenizer and
// text-encoder components: FLUX.1 (CLIP pooled + T5), FLUX.2 klein (Qwen3, chat template, layers
// 9/18/27), FLUX.2 dev (Mistral-3, system message and chat template, layers 10/20/30), Qwen-Image
// (Qwen2.5-VL, template, prefix dropped, mask).
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>

#include "shardit/io/model_folder.h"
#include "shardit/pipelines/pipeline.h"

namespace shardit::pipelines {

/// How the text encoders of a pipeline are loaded.
struct TextEncoderLoadOptions {
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  /// The tensor-parallel degree (a divisor of the world size); nullopt: the largest divisor of the
  /// world that every text encoder's heads allow.
  std::optional<int> tp_degree;
  /// The ranks that encode one prompt together (a serving replica's; 0: the world): the degree
  /// divides it, so the encoders' groups stay within a replica.
  int replica_size = 0;
  /// The transformer's degree, for the note printed when the text encoders' differs.
  int transformer_tp_degree = 1;
};

/// Whether `folder` (a pipeline folder) lists the tokenizer and text-encoder components
/// `pipeline_class` encodes prompts with.
bool has_prompt_encoder_components(const io::ModelFolder& folder, const std::string& pipeline_class);

/// The PromptEncoder of `pipeline_class` ("FluxPipeline", "Flux2KleinPipeline", "Flux2Pipeline",
/// "QwenImagePipeline") from `folder`'s components, weights loaded. Each text encoder's class is
/// checked before any weight is read. Collective over the world.
std::shared_ptr<PromptEncoder> load_prompt_encoder(const io::ModelFolder& folder, const std::string& pipeline_class,
                                                   const TextEncoderLoadOptions& options);

}  // namespace shardit::pipelines
