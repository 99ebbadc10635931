#include "shardit/models/registry.h"

#include <c10/util/Exception.h>

#include <functional>
#include <sstream>
#include <utility>

#include "shardit/models/flux/transformer_flux.h"

namespace shardit::models {

namespace {

using Factory =
    std::function<std::shared_ptr<parallel::TensorParallelModule>(const nlohmann::json& config, const std::string& source)>;

/// One entry per supported diffusers transformer class.
const std::vector<std::pair<std::string, Factory>>& factories() {
  static const std::vector<std::pair<std::string, Factory>> table = {
      {"FluxTransformer2DModel",
       [](const nlohmann::json& config, const std::string& source) {
         return std::make_shared<FluxTransformer2DModel>(FluxTransformer2DModelConfig::from_json(config, source));
       }},
  };
  return table;
}

}  // namespace

std::vector<std::string> supported_transformer_classes() {
  std::vector<std::string> names;
  for (const auto& [name, factory] : factories()) names.push_back(name);
  return names;
}

std::shared_ptr<parallel::TensorParallelModule> create_transformer(const io::ComponentFolder& folder) {
  const std::string source = folder.dir + "/config.json";
  const std::string class_name = folder.class_name();
  for (const auto& [name, factory] : factories()) {
    if (name == class_name) return factory(folder.config, source);
  }
  std::ostringstream supported;
  for (const auto& name : supported_transformer_classes()) supported << (supported.tellp() > 0 ? ", " : "") << name;
  TORCH_CHECK(false, source, ": unsupported transformer class '", class_name.empty() ? "(no _class_name)" : class_name,
              "'; supported: ", supported.str());
}

}  // namespace shardit::models
