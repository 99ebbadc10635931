#pragma once
// The component registry: which classes a diffusers pipeline folder may name in model_index.json
// (library, class) for each kind of component, and how to build them from their folders.
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/models/single_file.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/schedulers/scheduling_flow_match_euler_discrete.h"
#include "shardit/tokenizers/tokenizer.h"

namespace shardit::models {

/// The kinds of component of a pipeline, named as diffusers names their folders.
enum class ComponentKind { Transformer, TextEncoder, Tokenizer, Scheduler, Vae };
/// "transformer", "text_encoder", "tokenizer", "scheduler", "vae".
const char* component_kind_name(ComponentKind kind);

class AutoencoderModel;

/// A class the registry can build: its model_index.json [library, class] pair and its kind.
struct ComponentClass {
  std::string library;     ///< "diffusers", "transformers"
  std::string class_name;  ///< "FluxTransformer2DModel"
  ComponentKind kind;
  /// Builds a module component from its folder's config, parameters on the meta device (load them
  /// with TensorParallelModule::load).
  std::function<std::shared_ptr<parallel::TensorParallelModule>(const io::ComponentFolder& folder)> create_module;
  /// Tokenizer classes: the tokenizer that reads the folder's files.
  std::optional<tokenizers::TokenizerKind> tokenizer_kind;
  /// Transformer classes: the layouts of the single files it loads (`--transformer FILE`), each
  /// detected from the keys and mapped by its table (the class's `single_file_layouts()`).
  std::vector<SingleFileLayout> single_file_layouts = {};
};

/// Every supported class, of every kind.
const std::vector<ComponentClass>& component_classes();

/// The registered class of `kind` named `class_name`; an error naming `source` and listing the
/// supported classes of that kind otherwise.
const ComponentClass& find_component_class(ComponentKind kind, const std::string& class_name,
                                           const std::string& source);

/// The transformer class named by `folder`'s config.json `_class_name`, built from that config
/// with its parameters declared on the meta device (load them with TensorParallelModule::load).
/// Errors name the folder and list the supported classes.
std::shared_ptr<parallel::TensorParallelModule> create_transformer(const io::ComponentFolder& folder);

/// The transformer weights of the single file `path` as a checkpoint of `model`, an instance of the
/// transformer class `class_name` (its config from the model folder): the file's layout is
/// detected from its keys among the class's single-file layouts and mapped to the model's names.
/// Before anything is read, an error names the file when it is missing or unreadable, when it
/// holds another registered class's transformer (naming that class), or when no layout matches
/// (listing the keys each layout expects); single_file_mapping's errors name missing tensors.
io::Checkpoint open_transformer_file(const std::string& path, const std::string& class_name, nn::Module& model);

/// The tokenizer a pipeline's model_index.json names `class_name` for, read from `folder`.
std::unique_ptr<tokenizers::Tokenizer> create_tokenizer(const std::string& folder, const std::string& class_name);

/// The scheduler a pipeline's model_index.json names `class_name` for, configured from
/// `folder`/scheduler_config.json.
schedulers::FlowMatchEulerDiscreteScheduler create_scheduler(const std::string& folder, const std::string& class_name);

/// The text-encoder class named by `folder`'s config.json (`architectures`, as transformers writes
/// it: CLIPTextModel, T5EncoderModel, Qwen3ForCausalLM, Qwen2_5_VLForConditionalGeneration,
/// Mistral3ForConditionalGeneration), built
/// with its parameters on the meta device. Errors name the folder and list the supported classes.
std::shared_ptr<parallel::TensorParallelModule> create_text_encoder(const io::ComponentFolder& folder);

/// Any module component (transformer, text encoder, VAE) by the class its config.json names.
std::shared_ptr<parallel::TensorParallelModule> create_module_component(const io::ComponentFolder& folder);

/// The `_class_name` values of `kind` the registry accepts.
std::vector<std::string> supported_classes(ComponentKind kind);

/// The VAE class named by `folder`'s config.json `_class_name` (AutoencoderKL,
/// AutoencoderKLFlux2, AutoencoderKLQwenImage), built from that config with its decoder
/// parameters on the meta device (load them with TensorParallelModule::load). Errors name the
/// folder and list the supported classes.
std::shared_ptr<AutoencoderModel> create_vae(const io::ComponentFolder& folder);

}  // namespace shardit::models
