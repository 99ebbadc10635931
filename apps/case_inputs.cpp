// Golden-style case folders (inputs.safetensors + inputs.json), as run-transformer, run-encoder,
// run-vae and check-backends take them.
#include <filesystem>
#include <string>

#include "apps/commands.h"
#include "shardit/io/json.h"
#include "shardit/io/model_folder.h"

namespace shardit::apps {

CaseInputs read_case_inputs(const std::string& inputs, const io::ComponentFolder& component) {
  namespace fs = std::filesystem;
  CaseInputs found;
  found.file = fs::is_directory(inputs) ? (fs::path(inputs) / "inputs.safetensors").string() : inputs;
  found.json_file = (fs::path(found.file).parent_path() / "inputs.json").string();
  // A dangling link is read too, so that the error names it.
  if (!fs::exists(fs::symlink_status(found.json_file))) return found;
  found.meta = io::read_json_file(found.json_file);
  if (found.meta.contains("model_class") && found.meta.at("model_class").is_string()) {
    TORCH_CHECK(found.meta.at("model_class").get<std::string>() == component.class_name(), found.json_file,
                ": inputs are for '", found.meta.at("model_class").get<std::string>(), "', but ", component.dir,
                " holds a '", component.class_name(), "'");
  }
  return found;
}

}  // namespace shardit::apps
