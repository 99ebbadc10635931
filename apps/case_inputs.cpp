// Golden-style case folders (inputs.safetensors + inputs.json), as run-transformer, run-encoder
// and run-vae take them.
#include <filesystem>
#include <string>

#include "apps/commands.h"
#include "shardit/io/model_folder.h"

namespace shardit::apps {

std::string case_inputs_file(const std::string& inputs, const io::ComponentFolder& component) {
  namespace fs = std::filesystem;
  const std::string path = fs::is_directory(inputs) ? (fs::path(inputs) / "inputs.safetensors").string() : inputs;
  const fs::path inputs_json = fs::path(path).parent_path() / "inputs.json";
  if (fs::exists(inputs_json)) {
    const nlohmann::json meta = io::read_json_file(inputs_json.string());
    if (meta.contains("model_class") && meta.at("model_class").is_string()) {
      TORCH_CHECK(meta.at("model_class").get<std::string>() == component.class_name(), inputs_json.string(),
                  ": inputs are for '", meta.at("model_class").get<std::string>(), "', but ", component.dir,
                  " holds a '", component.class_name(), "'");
    }
  }
  return path;
}

}  // namespace shardit::apps
