#include "shardit/models/registry.h"

#include <c10/util/Exception.h>

#include <functional>
#include <sstream>
#include <utility>

#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/flux2/transformer_flux2.h"
#include "shardit/models/qwen_image/transformer_qwenimage.h"
#include "shardit/models/vae/autoencoder_kl.h"
#include "shardit/models/vae/autoencoder_kl_flux2.h"
#include "shardit/models/vae/autoencoder_kl_qwenimage.h"

namespace shardit::models {

namespace {

using Factory =
    std::function<std::shared_ptr<parallel::TensorParallelModule>(const nlohmann::json& config, const std::string& source)>;
/// Reads the forward's keyword arguments from a file and runs the forward.
using FileForward = std::function<at::Tensor(parallel::TensorParallelModule& model, const io::SafetensorsFile& inputs,
                                             const IntermediateRecorder& record)>;

struct TransformerClass {
  std::string name;
  Factory create;
  FileForward forward_from_file;
};

/// The forward of `Model`, with its inputs read by `Model`'s input struct.
template <class Model, class Inputs>
FileForward file_forward() {
  return [](parallel::TensorParallelModule& model, const io::SafetensorsFile& inputs, const IntermediateRecorder& record) {
    auto* typed = dynamic_cast<Model*>(&model);
    TORCH_INTERNAL_ASSERT(typed != nullptr, "forward_from_file: model is a ", model.type_name());
    return typed->forward(Inputs::read(inputs), record);
  };
}

/// One entry per supported diffusers transformer class.
const std::vector<TransformerClass>& classes() {
  static const std::vector<TransformerClass> table = {
      {"FluxTransformer2DModel",
       [](const nlohmann::json& config, const std::string& source) {
         return std::make_shared<FluxTransformer2DModel>(FluxTransformer2DModelConfig::from_json(config, source));
       },
       file_forward<FluxTransformer2DModel, FluxTransformer2DModelInputs>()},
      {"Flux2Transformer2DModel",
       [](const nlohmann::json& config, const std::string& source) {
         return std::make_shared<Flux2Transformer2DModel>(Flux2Transformer2DModelConfig::from_json(config, source));
       },
       file_forward<Flux2Transformer2DModel, Flux2Transformer2DModelInputs>()},
      {"QwenImageTransformer2DModel",
       [](const nlohmann::json& config, const std::string& source) {
         return std::make_shared<QwenImageTransformer2DModel>(QwenImageTransformer2DModelConfig::from_json(config, source));
       },
       file_forward<QwenImageTransformer2DModel, QwenImageTransformer2DModelInputs>()},
  };
  return table;
}

}  // namespace

IntermediateRecorder prefixed_recorder(const IntermediateRecorder& record, std::string prefix) {
  if (!record) return {};
  return [record, prefix = std::move(prefix)](const std::string& name, const at::Tensor& value) {
    record(prefix + name, value);
  };
}

std::vector<std::string> supported_transformer_classes() {
  std::vector<std::string> names;
  for (const auto& entry : classes()) names.push_back(entry.name);
  return names;
}

std::shared_ptr<parallel::TensorParallelModule> create_transformer(const io::ComponentFolder& folder) {
  const std::string source = folder.dir + "/config.json";
  const std::string class_name = folder.class_name();
  for (const auto& entry : classes()) {
    if (entry.name == class_name) return entry.create(folder.config, source);
  }
  std::ostringstream supported;
  for (const auto& name : supported_transformer_classes()) supported << (supported.tellp() > 0 ? ", " : "") << name;
  TORCH_CHECK(false, source, ": unsupported transformer class '", class_name.empty() ? "(no _class_name)" : class_name,
              "'; supported: ", supported.str());
}

at::Tensor forward_from_file(parallel::TensorParallelModule& model, const io::SafetensorsFile& inputs,
                             const IntermediateRecorder& record) {
  for (const auto& entry : classes()) {
    if (entry.name == model.type_name()) return entry.forward_from_file(model, inputs, record);
  }
  TORCH_CHECK(false, inputs.path(), ": no input reader for '", model.type_name(), "'");
}

std::vector<std::string> supported_vae_classes() {
  return {"AutoencoderKL", "AutoencoderKLFlux2", "AutoencoderKLQwenImage"};
}

std::shared_ptr<AutoencoderModel> create_vae(const io::ComponentFolder& folder) {
  const std::string source = folder.dir + "/config.json";
  const std::string class_name = folder.class_name();
  if (class_name == "AutoencoderKL") {
    return std::make_shared<AutoencoderKL>(AutoencoderKLConfig::from_json(folder.config, source), source);
  }
  if (class_name == "AutoencoderKLFlux2") {
    return std::make_shared<AutoencoderKLFlux2>(AutoencoderKLFlux2Config::from_json(folder.config, source), source);
  }
  if (class_name == "AutoencoderKLQwenImage") {
    return std::make_shared<AutoencoderKLQwenImage>(AutoencoderKLQwenImageConfig::from_json(folder.config, source));
  }
  std::ostringstream supported;
  for (const auto& name : supported_vae_classes()) supported << (supported.tellp() > 0 ? ", " : "") << name;
  TORCH_CHECK(false, source, ": unsupported VAE class '", class_name.empty() ? "(no _class_name)" : class_name,
              "'; supported: ", supported.str());
}

}  // namespace shardit::models
