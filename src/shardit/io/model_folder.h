#pragma once
// diffusers-format model folders: model_index.json naming components, each component a folder
// with config.json and its safetensors weights (single or sharded).
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "shardit/io/safetensors.h"

namespace shardit::io {

/// One component folder (e.g. `transformer/`): its parsed config.json and its weights.
struct ComponentFolder {
  std::string dir;
  std::string name;        ///< component name ("transformer"), or the folder name
  nlohmann::json config;   ///< config.json
  /// `_class_name` of the config, or "" when absent.
  std::string class_name() const;
  /// Opens the component's weights (error naming the folder when none are there).
  Checkpoint weights() const;
};

/// A diffusers pipeline folder (with model_index.json) or a single component folder.
class ModelFolder {
 public:
  /// Opens `path`: a folder with model_index.json, or a component folder with config.json.
  /// Missing pieces give an error naming the path and what is missing.
  static ModelFolder open(const std::string& path);

  const std::string& root() const { return root_; }
  /// True when opened on a pipeline folder with model_index.json.
  bool is_pipeline() const { return !model_index_.is_null(); }
  const nlohmann::json& model_index() const { return model_index_; }
  /// Component names listed in model_index.json (those with a [library, class] pair), sorted.
  std::vector<std::string> components() const;
  /// A component by name ("transformer", "vae", "text_encoder"...). On a component folder,
  /// `component("")` or the folder's own name returns it.
  ComponentFolder component(const std::string& name) const;

 private:
  std::string root_;
  nlohmann::json model_index_;
};

/// The component `name` ("transformer") of the pipeline folder at `path`, or the folder itself
/// when `path` is a component folder (a `transformer/` folder given directly, a test case).
ComponentFolder open_component(const std::string& path, const std::string& name);

/// `config[key]` as a T, or `fallback` when the key is absent or null (diffusers' defaults).
/// A value of the wrong type is an error naming `source` (the config file), the key and the value.
template <class T>
T config_value(const nlohmann::json& config, const char* key, T fallback, const std::string& source) {
  if (!config.contains(key) || config.at(key).is_null()) return fallback;
  try {
    return config.at(key).get<T>();
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, source, ": key '", key, "' has an unexpected type (", config.at(key).dump(), "): ", e.what());
  }
}

/// Reads a JSON file with an error naming the file on any problem, including a file larger than
/// `max_bytes` or nested deeper than `max_depth`.
nlohmann::json read_json_file(const std::string& path, std::uintmax_t max_bytes = 64ull << 20, int max_depth = 64);

}  // namespace shardit::io
