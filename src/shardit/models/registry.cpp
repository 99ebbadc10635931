#include "shardit/models/registry.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "shardit/io/json.h"
#include "shardit/models/clip/modeling_clip.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/flux2/transformer_flux2.h"
#include "shardit/models/mistral/modeling_mistral3.h"
#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/models/qwen_image/transformer_qwenimage.h"
#include "shardit/models/t5/modeling_t5.h"
#include "shardit/models/vae/autoencoder_kl.h"
#include "shardit/models/vae/autoencoder_kl_flux2.h"
#include "shardit/models/vae/autoencoder_kl_qwenimage.h"

namespace shardit::models {

namespace {

/// A module class built from its `<Class>Config::from_json`.
template <class Model, class Config>
ComponentClass module_class(const char* library, const char* class_name, ComponentKind kind,
                            std::vector<SingleFileLayout> single_file_layouts = {}) {
  return {library, class_name, kind, [](const io::ComponentFolder& folder) -> std::shared_ptr<parallel::TensorParallelModule> {
            return std::make_shared<Model>(Config::from_json(folder.config, folder.dir + "/config.json"));
          },
          std::nullopt, std::move(single_file_layouts)};
}

/// "'a', 'b'".
std::string quoted_list(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "'" : ", '") + name + "'";
  return out;
}

ComponentClass tokenizer_class(const char* class_name, tokenizers::TokenizerKind kind) {
  return {"transformers", class_name, ComponentKind::Tokenizer, {}, kind};
}

/// Whether the pipeline folder holding `folder` lists a `processor` component in its
/// model_index.json (an image processor: the text encoder then reads images too).
bool pipeline_has_image_processor(const io::ComponentFolder& folder) {
  std::filesystem::path dir = std::filesystem::path(folder.dir).lexically_normal();
  if (!dir.has_filename()) dir = dir.parent_path();  // a trailing separator
  const std::filesystem::path index = dir.parent_path() / "model_index.json";
  if (folder.dir.empty() || !std::filesystem::is_regular_file(index)) return false;
  const nlohmann::json model_index = io::read_json_file(index.string());
  return model_index.is_object() && model_index.contains("processor") && model_index.at("processor").is_array();
}

}  // namespace

const char* component_kind_name(ComponentKind kind) {
  switch (kind) {
    case ComponentKind::Transformer: return "transformer";
    case ComponentKind::TextEncoder: return "text_encoder";
    case ComponentKind::Tokenizer: return "tokenizer";
    case ComponentKind::Scheduler: return "scheduler";
    case ComponentKind::Vae: return "vae";
  }
  return "?";
}

const std::vector<ComponentClass>& component_classes() {
  static const std::vector<ComponentClass> table = {
      module_class<FluxTransformer2DModel, FluxTransformer2DModelConfig>(
          "diffusers", "FluxTransformer2DModel", ComponentKind::Transformer,
          FluxTransformer2DModel::single_file_layouts()),
      module_class<Flux2Transformer2DModel, Flux2Transformer2DModelConfig>(
          "diffusers", "Flux2Transformer2DModel", ComponentKind::Transformer,
          Flux2Transformer2DModel::single_file_layouts()),
      module_class<QwenImageTransformer2DModel, QwenImageTransformer2DModelConfig>(
          "diffusers", "QwenImageTransformer2DModel", ComponentKind::Transformer,
          QwenImageTransformer2DModel::single_file_layouts()),
      {"diffusers", "AutoencoderKL", ComponentKind::Vae,
       [](const io::ComponentFolder& folder) -> std::shared_ptr<parallel::TensorParallelModule> {
         const std::string source = folder.dir + "/config.json";
         return std::make_shared<AutoencoderKL>(AutoencoderKLConfig::from_json(folder.config, source), source);
       },
       std::nullopt},
      {"diffusers", "AutoencoderKLFlux2", ComponentKind::Vae,
       [](const io::ComponentFolder& folder) -> std::shared_ptr<parallel::TensorParallelModule> {
         const std::string source = folder.dir + "/config.json";
         return std::make_shared<AutoencoderKLFlux2>(AutoencoderKLFlux2Config::from_json(folder.config, source), source);
       },
       std::nullopt},
      module_class<AutoencoderKLQwenImage, AutoencoderKLQwenImageConfig>("diffusers", "AutoencoderKLQwenImage",
                                                                         ComponentKind::Vae),
      module_class<CLIPTextModel, CLIPTextConfig>("transformers", "CLIPTextModel", ComponentKind::TextEncoder),
      module_class<T5EncoderModel, T5Config>("transformers", "T5EncoderModel", ComponentKind::TextEncoder),
      module_class<Qwen3ForCausalLM, Qwen3Config>("transformers", "Qwen3ForCausalLM", ComponentKind::TextEncoder),
      {"transformers", "Qwen2_5_VLForConditionalGeneration", ComponentKind::TextEncoder,
       [](const io::ComponentFolder& folder) -> std::shared_ptr<parallel::TensorParallelModule> {
         const std::string source = folder.dir + "/config.json";
         const Qwen3Config text = qwen2_5_vl_text_config_from_json(folder.config, source);
         // The vision tower is built when the pipeline feeds it images: its folder has an image
         // processor component (diffusers' Qwen-Image edit pipelines' `processor`).
         if (!pipeline_has_image_processor(folder)) return std::make_shared<Qwen2_5_VLForConditionalGeneration>(text);
         return std::make_shared<Qwen2_5_VLForConditionalGeneration>(
             text, qwen2_5_vl_image_config_from_json(folder.config, source, text));
       },
       std::nullopt},
      module_class<Mistral3ForConditionalGeneration, Mistral3Config>("transformers", "Mistral3ForConditionalGeneration",
                                                                     ComponentKind::TextEncoder),
      tokenizer_class("CLIPTokenizer", tokenizers::TokenizerKind::Clip),
      tokenizer_class("CLIPTokenizerFast", tokenizers::TokenizerKind::Clip),
      tokenizer_class("T5Tokenizer", tokenizers::TokenizerKind::T5),
      tokenizer_class("T5TokenizerFast", tokenizers::TokenizerKind::T5),
      tokenizer_class("Qwen2Tokenizer", tokenizers::TokenizerKind::Qwen),
      tokenizer_class("Qwen2TokenizerFast", tokenizers::TokenizerKind::Qwen),
      // FLUX.2 [dev]: Mistral's Tekken tokenizer as transformers converts it (tokenizer.json), in a
      // PixtralProcessor folder; only its text path is used.
      tokenizer_class("LlamaTokenizerFast", tokenizers::TokenizerKind::Qwen),
      tokenizer_class("PixtralProcessor", tokenizers::TokenizerKind::Qwen),
      {"diffusers", "FlowMatchEulerDiscreteScheduler", ComponentKind::Scheduler, {}, std::nullopt},
  };
  return table;
}

std::vector<std::string> supported_classes(ComponentKind kind) {
  std::vector<std::string> names;
  for (const auto& entry : component_classes()) {
    if (entry.kind == kind) names.push_back(entry.class_name);
  }
  return names;
}

const ComponentClass& find_component_class(ComponentKind kind, const std::string& class_name,
                                           const std::string& source) {
  for (const auto& entry : component_classes()) {
    if (entry.kind == kind && entry.class_name == class_name) return entry;
  }
  std::ostringstream supported;
  for (const auto& name : supported_classes(kind)) supported << (supported.tellp() > 0 ? ", " : "") << name;
  TORCH_CHECK(false, source, ": unsupported ", component_kind_name(kind), " class '",
              class_name.empty() ? "(no _class_name)" : class_name, "'; supported: ",
              supported.tellp() > 0 ? supported.str() : std::string("none yet"));
}

std::shared_ptr<parallel::TensorParallelModule> create_transformer(const io::ComponentFolder& folder) {
  return find_component_class(ComponentKind::Transformer, folder.class_name(), folder.dir + "/config.json")
      .create_module(folder);
}

io::Checkpoint open_transformer_file(const std::string& path, const std::string& class_name, nn::Module& model) {
  const ComponentClass& row = find_component_class(ComponentKind::Transformer, class_name, path);
  TORCH_CHECK(!std::filesystem::is_directory(path), path, ": --transformer takes one .safetensors file, not a folder "
              "(a diffusers transformer folder is the model folder's transformer/)");
  const io::Checkpoint file = io::Checkpoint::open(path);
  std::string prefix;
  if (const SingleFileLayout* layout = detect_single_file_layout(file, row.single_file_layouts, &prefix)) {
    return file.with_mapping(single_file_mapping(file, *layout, prefix, model));
  }
  for (const ComponentClass& other : component_classes()) {
    if (other.kind != ComponentKind::Transformer || other.class_name == class_name) continue;
    if (const SingleFileLayout* layout = detect_single_file_layout(file, other.single_file_layouts, &prefix)) {
      TORCH_CHECK(false, path, ": holds a ", other.class_name, " (", layout->name, " layout: has ",
                  quoted_list(layout->markers), "), but the model folder's transformer is ", class_name,
                  "; give a ", class_name, " file, or the model folder of its family");
    }
  }
  std::ostringstream expected;
  for (const SingleFileLayout& layout : row.single_file_layouts) {
    expected << (expected.tellp() > 0 ? "; or " : "") << layout.name << ": " << quoted_list(layout.markers);
  }
  const std::vector<std::string> names = file.source_names();
  const std::vector<std::string> first(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(
                                                                         std::min<size_t>(names.size(), 5)));
  TORCH_CHECK(false, path, ": is not a ", class_name, " file in a known layout: expected ", expected.str(),
              " (with or without the prefix 'model.diffusion_model.'); its ", names.size(), " tensors begin ",
              names.empty() ? std::string("(none)") : quoted_list(first));
}

std::unique_ptr<tokenizers::Tokenizer> create_tokenizer(const std::string& folder, const std::string& class_name) {
  const ComponentClass& entry = find_component_class(ComponentKind::Tokenizer, class_name, folder);
  return tokenizers::load_tokenizer(folder, *entry.tokenizer_kind);
}

schedulers::FlowMatchEulerDiscreteScheduler create_scheduler(const std::string& folder, const std::string& class_name) {
  find_component_class(ComponentKind::Scheduler, class_name, folder);
  return schedulers::FlowMatchEulerDiscreteScheduler::from_pretrained(folder);
}

std::shared_ptr<parallel::TensorParallelModule> create_text_encoder(const io::ComponentFolder& folder) {
  return find_component_class(ComponentKind::TextEncoder, folder.class_name(), folder.dir + "/config.json")
      .create_module(folder);
}

std::shared_ptr<parallel::TensorParallelModule> create_module_component(const io::ComponentFolder& folder) {
  const std::string class_name = folder.class_name();
  for (const auto& entry : component_classes()) {
    if (entry.class_name == class_name && entry.create_module) return entry.create_module(folder);
  }
  std::ostringstream supported;
  for (const auto& entry : component_classes()) {
    if (entry.create_module) supported << (supported.tellp() > 0 ? ", " : "") << entry.class_name;
  }
  TORCH_CHECK(false, folder.dir, "/config.json: unsupported model class '",
              class_name.empty() ? "(no _class_name or architectures)" : class_name, "'; supported: ", supported.str());
}

std::shared_ptr<AutoencoderModel> create_vae(const io::ComponentFolder& folder) {
  // Every Vae entry builds an AutoencoderModel.
  return std::static_pointer_cast<AutoencoderModel>(
      find_component_class(ComponentKind::Vae, folder.class_name(), folder.dir + "/config.json").create_module(folder));
}

}  // namespace shardit::models
