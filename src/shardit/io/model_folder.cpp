#include "shardit/io/model_folder.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "shardit/core/error.h"

namespace shardit::io {

namespace fs = std::filesystem;

namespace {

// diffusers models and transformers models use config.json; diffusers schedulers
// scheduler_config.json; tokenizers tokenizer_config.json.
constexpr const char* kConfigNames[] = {"config.json", "scheduler_config.json", "tokenizer_config.json"};

bool is_component_entry(const nlohmann::json& value) {
  return value.is_array() && value.size() == 2 && value[0].is_string() && value[1].is_string();
}

ComponentFolder load_component(const std::string& dir, const std::string& name) {
  TORCH_CHECK(fs::is_directory(dir), dir, ": component '", name, "' has no folder here");
  for (const char* config_name : kConfigNames) {
    const fs::path config_path = fs::path(dir) / config_name;
    if (fs::exists(config_path)) {
      ComponentFolder component;
      component.dir = dir;
      component.name = name;
      component.config = read_json_file(config_path.string());
      TORCH_CHECK(component.config.is_object(), config_path.string(), ": expected a JSON object, got a ",
                  component.config.type_name());
      return component;
    }
  }
  TORCH_CHECK(false, dir, ": component '", name,
              "' has no config.json (nor scheduler_config.json / tokenizer_config.json)");
}

std::string folder_name(const std::string& path) {
  fs::path p = fs::path(path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

}  // namespace

nlohmann::json read_json_file(const std::string& path, std::uintmax_t max_bytes, int max_depth) {
  TORCH_CHECK(fs::exists(path), path, ": no such file");
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  TORCH_CHECK(!ec, path, ": cannot read its size: ", ec.message());
  TORCH_CHECK(size <= max_bytes, path, ": ", size, " bytes, more than the ", max_bytes,
              " a JSON file here may have; is it the right file?");
  std::ifstream in(path);
  TORCH_CHECK(in, path, ": cannot open: ", std::strerror(errno));
  bool too_deep = false;
  const nlohmann::json::parser_callback_t limit_depth = [&](int depth, nlohmann::json::parse_event_t,
                                                             nlohmann::json&) {
    if (depth > max_depth) too_deep = true;
    return !too_deep;
  };
  nlohmann::json value;
  try {
    value = nlohmann::json::parse(in, limit_depth);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, path, ": invalid JSON (", e.what(), ")");
  }
  TORCH_CHECK(!too_deep, path, ": JSON nested deeper than ", max_depth, " levels");
  return value;
}

std::string ComponentFolder::class_name() const {
  const auto it = config.find("_class_name");
  return it != config.end() && it->is_string() ? it->get<std::string>() : std::string();
}

Checkpoint ComponentFolder::weights() const {
  TORCH_CHECK(fs::is_directory(dir), dir, ": component folder does not exist");
  return Checkpoint::open(dir);
}

ModelFolder ModelFolder::open(const std::string& path) {
  TORCH_CHECK(fs::exists(path), path, ": no such file or directory");
  TORCH_CHECK(fs::is_directory(path), path,
              ": not a folder (expected a diffusers pipeline folder with model_index.json, or a "
              "component folder with config.json)");
  ModelFolder folder;
  folder.root_ = path;
  const fs::path index_path = fs::path(path) / "model_index.json";
  if (fs::exists(index_path)) {
    folder.model_index_ = read_json_file(index_path.string());
    TORCH_CHECK(folder.model_index_.is_object(), index_path.string(), ": expected a JSON object, got a ",
                folder.model_index_.type_name());
    TORCH_CHECK(!folder.components().empty(), index_path.string(),
                ": lists no components (entries like \"transformer\": [\"diffusers\", \"FluxTransformer2DModel\"])");
    return folder;
  }
  TORCH_CHECK(fs::exists(fs::path(path) / "config.json"), path,
              ": neither model_index.json (a diffusers pipeline folder) nor config.json (a component "
              "folder) is here");
  return folder;
}

std::vector<std::string> ModelFolder::components() const {
  std::vector<std::string> out;
  if (!is_pipeline()) return out;
  for (const auto& [key, value] : model_index_.items()) {
    if (is_component_entry(value)) out.push_back(key);
  }
  std::sort(out.begin(), out.end());
  return out;
}

ComponentFolder ModelFolder::component(const std::string& name) const {
  if (!is_pipeline()) {
    const std::string own = folder_name(root_);
    TORCH_CHECK(name.empty() || name == own, root_, ": is a single component folder ('", own,
                "'), so it has no component '", name, "'");
    return load_component(root_, own);
  }
  const auto names = components();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::string listed;
    for (const auto& item : names) listed += (listed.empty() ? "" : ", ") + item;
    TORCH_CHECK(false, root_, ": model_index.json has no component '", name, "' (it has: ", listed, ")");
  }
  return load_component((fs::path(root_) / name).string(), name);
}

ComponentFolder open_component(const std::string& path, const std::string& name) {
  const ModelFolder folder = ModelFolder::open(path);
  return folder.is_pipeline() ? folder.component(name) : folder.component("");
}

}  // namespace shardit::io
