#pragma once
// How a pipeline class turns prompts into embeddings, as data on the class: the tokenizer and
// text-encoder components it encodes with (diffusers' pipeline components) and how a
// PromptEncoder is made of them once loaded (each family's pipeline file gives its recipe,
// `<Pipeline>::prompt_encoder_recipe()`); and the one loader that opens, shards and loads those
// components for any recipe.
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/pipelines/pipeline.h"
#include "shardit/tokenizers/tokenizer.h"

namespace shardit::pipelines {

/// What a pipeline holds of a text encoder: the module (parameters on the meta device until
/// loaded) and, when that is not the whole checkpoint, which part of it, for people ("layers 1-30
/// of 40").
struct HeldTextEncoder {
  std::shared_ptr<parallel::TensorParallelModule> module;
  std::string part;  ///< "" for the whole model
};

/// One text encoder a pipeline class encodes prompts with.
struct TextEncoderSlot {
  std::string tokenizer;     ///< its tokenizer component: "tokenizer_2"
  std::string text_encoder;  ///< its encoder component: "text_encoder_2"
  std::string class_name;    ///< the encoder class the pipeline takes there: "T5EncoderModel"
  /// Builds what the pipeline holds of the encoder when that is less than the registry's whole
  /// class (models::create_text_encoder); unset: the whole class.
  std::function<HeldTextEncoder(const io::ComponentFolder& folder)> build_part;
};

/// A pipeline class's prompt encoding: its text encoders, and how its PromptEncoder is made of
/// the pipeline folder (for what else it reads there: the edit pipelines' image processor), the
/// tokenizers and the loaded encoders (both in the slots' order).
struct PromptEncoderRecipe {
  std::vector<TextEncoderSlot> slots;
  std::function<std::shared_ptr<PromptEncoder>(const io::ModelFolder& folder,
                                               std::vector<std::unique_ptr<tokenizers::Tokenizer>> tokenizers,
                                               std::vector<std::shared_ptr<parallel::TensorParallelModule>> encoders)>
      make;
};

/// What a pipeline holds of `slot`'s encoder in `folder` (built on the meta device).
HeldTextEncoder held_text_encoder(const TextEncoderSlot& slot, const io::ComponentFolder& folder);

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

/// Whether `folder` (a pipeline folder) lists every tokenizer and text-encoder component of `recipe`.
bool has_prompt_encoder_components(const io::ModelFolder& folder, const PromptEncoderRecipe& recipe);

/// The PromptEncoder `recipe` makes for `pipeline_class` from `folder`'s components, weights
/// loaded. Each text encoder's class is checked before any weight is read. Collective over the world.
std::shared_ptr<PromptEncoder> load_prompt_encoder(const io::ModelFolder& folder, const std::string& pipeline_class,
                                                   const PromptEncoderRecipe& recipe,
                                                   const TextEncoderLoadOptions& options);

/// One field of a batch of encodings as int64 [B, S]: the ids, or with `mask` the attention mask
/// (rows padded to one length by the tokenizer).
at::Tensor token_rows(const std::vector<tokenizers::Encoding>& rows, bool mask);

/// A loaded encoder as the class its slot named (load_prompt_encoder checked it).
template <typename Model>
std::shared_ptr<Model> encoder_as(const std::shared_ptr<parallel::TensorParallelModule>& module) {
  auto model = std::dynamic_pointer_cast<Model>(module);
  TORCH_INTERNAL_ASSERT(model != nullptr, "text encoder ", module->type_name(), " is not the class checked before");
  return model;
}

}  // namespace shardit::pipelines
