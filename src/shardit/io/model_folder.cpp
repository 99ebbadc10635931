#include "shardit/io/model_folder.h"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <filesystem>

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
    if (fs::exists(fs::symlink_status(config_path))) {  // a dangling link is reported, not skipped
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

std::string ComponentFolder::class_name() const {
  const auto it = config.find("_class_name");
  if (it != config.end() && it->is_string()) return it->get<std::string>();
  // transformers' configs name the class in a one-entry `architectures` list.
  const auto architectures = config.find("architectures");
  if (architectures != config.end() && architectures->is_array() && architectures->size() == 1 &&
      (*architectures)[0].is_string()) {
    return (*architectures)[0].get<std::string>();
  }
  return std::string();
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
  if (fs::exists(fs::symlink_status(index_path))) {
    folder.model_index_ = read_json_file(index_path.string());
    TORCH_CHECK(folder.model_index_.is_object(), index_path.string(), ": expected a JSON object, got a ",
                folder.model_index_.type_name());
    TORCH_CHECK(!folder.components().empty(), index_path.string(),
                ": lists no components (entries like \"transformer\": [\"diffusers\", \"FluxTransformer2DModel\"])");
    // A component is the folder of that name beside model_index.json: a key that is a path
    // ("../../x", "/etc") would make every reader leave the pipeline folder.
    for (const std::string& name : folder.components()) {
      const bool plain = !name.empty() && name != "." && name != ".." &&
                         std::none_of(name.begin(), name.end(), [](char c) {
                           return c == '/' || c == '\\' || static_cast<unsigned char>(c) < 0x20;
                         });
      TORCH_CHECK(plain, index_path.string(), ": component ", quoted(name),
                  " is not a folder name (a component is the folder of that name beside model_index.json); "
                  "rename the key");
    }
    return folder;
  }
  TORCH_CHECK(fs::exists(fs::symlink_status(fs::path(path) / "config.json")), path,
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

// ---------------------------------------------------------------------------------------------
// ConfigReader

namespace {

// An integer JSON value within [min, max]; `what` names it in errors ("key 'num_layers'").
int64_t checked_integer(const nlohmann::json& value, const std::string& source, const std::string& what, int64_t min,
                        int64_t max) {
  TORCH_CHECK(value.is_number_integer(), source, ": ", what, " is ", brief(value), ", expected an integer in [", min,
              ", ", max, "]");
  const bool in_range = value.is_number_unsigned()
                            ? value.get<uint64_t>() <= static_cast<uint64_t>(std::max<int64_t>(max, 0)) &&
                                  static_cast<int64_t>(value.get<uint64_t>()) >= min
                            : value.get<int64_t>() >= min && value.get<int64_t>() <= max;
  TORCH_CHECK(in_range, source, ": ", what, " is ", brief(value), ", out of the accepted range [", min, ", ", max, "]");
  return value.get<int64_t>();
}

// A finite JSON number within [min, max]; `what` names it in errors. Bounds of kAnyFiniteNumber
// read as "a finite number".
double checked_number(const nlohmann::json& value, const std::string& source, const std::string& what, double min,
                      double max) {
  const bool any_finite = min == -kAnyFiniteNumber && max == kAnyFiniteNumber;
  if (any_finite) {
    TORCH_CHECK(value.is_number() && std::isfinite(value.get<double>()), source, ": ", what, " is ", brief(value),
                ", expected a finite number");
    return value.get<double>();
  }
  TORCH_CHECK(value.is_number(), source, ": ", what, " is ", brief(value), ", expected a number in [", min, ", ", max,
              "]");
  const double number = value.get<double>();
  TORCH_CHECK(std::isfinite(number) && number >= min && number <= max, source, ": ", what, " is ", brief(value),
              ", out of the accepted range [", min, ", ", max, "]");
  return number;
}

bool checked_boolean(const nlohmann::json& value, const std::string& source, const std::string& what) {
  TORCH_CHECK(value.is_boolean(), source, ": ", what, " is ", brief(value), ", expected true or false");
  return value.get<bool>();
}

std::string checked_string(const nlohmann::json& value, const std::string& source, const std::string& what) {
  TORCH_CHECK(value.is_string(), source, ": ", what, " is ", brief(value), ", expected a string");
  return value.get<std::string>();
}

std::string key_name(const char* key) { return std::string("key '") + key + "'"; }

}  // namespace

ConfigReader::ConfigReader(const nlohmann::json& config, std::string source)
    : config_(config), source_(std::move(source)) {
  TORCH_CHECK(config_.is_object(), source_, ": expected a JSON object, got a ", config_.type_name());
}

const nlohmann::json* ConfigReader::find(const char* key, const char* expected) const {
  const auto it = config_.find(key);
  if (it == config_.end()) return nullptr;
  TORCH_CHECK(!it->is_null(), source_, ": key '", key, "' is null, expected ", expected,
              "; give a value or remove the key to use the default");
  return &*it;
}

const nlohmann::json* ConfigReader::find_optional(const char* key) const {
  const auto it = config_.find(key);
  return it == config_.end() || it->is_null() ? nullptr : &*it;
}

template <class T, class Entry>
std::vector<T> ConfigReader::read_list(const char* key, const nlohmann::json& value, const char* expected,
                                       size_t max_count, Entry entry) const {
  TORCH_CHECK(value.is_array() && value.size() <= max_count, source_, ": key '", key, "' is ", brief(value),
              ", expected a list of at most ", max_count, " ", expected);
  std::vector<T> out;
  for (size_t i = 0; i < value.size(); ++i) {
    out.push_back(entry(value[i], key_name(key) + " entry " + std::to_string(i)));
  }
  return out;
}

int64_t ConfigReader::integer(const char* key, int64_t fallback, int64_t min, int64_t max) const {
  const nlohmann::json* value = find(key, "an integer");
  return value ? checked_integer(*value, source_, key_name(key), min, max) : fallback;
}

std::optional<int64_t> ConfigReader::optional_integer(const char* key, int64_t min, int64_t max) const {
  const nlohmann::json* value = find_optional(key);
  if (value == nullptr) return std::nullopt;
  return checked_integer(*value, source_, key_name(key), min, max);
}

double ConfigReader::number(const char* key, double fallback, double min, double max) const {
  const nlohmann::json* value = find(key, "a number");
  return value ? checked_number(*value, source_, key_name(key), min, max) : fallback;
}

std::optional<double> ConfigReader::optional_number(const char* key, double min, double max) const {
  const nlohmann::json* value = find_optional(key);
  if (value == nullptr) return std::nullopt;
  return checked_number(*value, source_, key_name(key), min, max);
}

bool ConfigReader::boolean(const char* key, bool fallback) const {
  const nlohmann::json* value = find(key, "true or false");
  return value ? checked_boolean(*value, source_, key_name(key)) : fallback;
}

std::optional<bool> ConfigReader::optional_boolean(const char* key) const {
  const nlohmann::json* value = find_optional(key);
  if (value == nullptr) return std::nullopt;
  return checked_boolean(*value, source_, key_name(key));
}

std::string ConfigReader::string(const char* key, std::string fallback) const {
  const nlohmann::json* value = find(key, "a string");
  return value ? checked_string(*value, source_, key_name(key)) : fallback;
}

std::vector<int64_t> ConfigReader::integers(const char* key, std::vector<int64_t> fallback, int64_t min, int64_t max,
                                            size_t max_count) const {
  const nlohmann::json* value = find(key, "a list of integers");
  if (value == nullptr) return fallback;
  return read_list<int64_t>(key, *value, "integers", max_count,
                            [&](const nlohmann::json& entry, const std::string& what) {
                              return checked_integer(entry, source_, what, min, max);
                            });
}

std::optional<std::vector<int64_t>> ConfigReader::optional_integers(const char* key, int64_t min, int64_t max,
                                                                    size_t max_count) const {
  if (find_optional(key) == nullptr) return std::nullopt;
  return integers(key, {}, min, max, max_count);
}

std::vector<double> ConfigReader::numbers(const char* key, std::vector<double> fallback, double min, double max,
                                          size_t max_count) const {
  const nlohmann::json* value = find(key, "a list of numbers");
  if (value == nullptr) return fallback;
  return read_list<double>(key, *value, "numbers", max_count,
                           [&](const nlohmann::json& entry, const std::string& what) {
                             return checked_number(entry, source_, what, min, max);
                           });
}

std::vector<bool> ConfigReader::booleans(const char* key, std::vector<bool> fallback, size_t max_count) const {
  const nlohmann::json* value = find(key, "a list of booleans");
  if (value == nullptr) return fallback;
  return read_list<bool>(key, *value, "booleans", max_count, [&](const nlohmann::json& entry, const std::string& what) {
    return checked_boolean(entry, source_, what);
  });
}

std::vector<std::string> ConfigReader::strings(const char* key, std::vector<std::string> fallback,
                                               size_t max_count) const {
  const nlohmann::json* value = find(key, "a list of strings");
  if (value == nullptr) return fallback;
  return read_list<std::string>(key, *value, "strings", max_count,
                           [&](const nlohmann::json& entry, const std::string& what) {
                             return checked_string(entry, source_, what);
                           });
}

std::vector<int64_t> ConfigReader::rope_axes(const char* key, std::vector<int64_t> fallback, const char* sum_key,
                                             int64_t sum, size_t count) const {
  const std::vector<int64_t> axes = integers(key, std::move(fallback), 2, kMaxConfigDim, 16);
  require(!axes.empty() && (count == 0 || axes.size() == count), "key '", key, "' has ", axes.size(), " entries, expected ",
          count == 0 ? std::string("at least 1") : std::to_string(count));
  int64_t total = 0;
  for (const int64_t d : axes) {
    require(d % 2 == 0, "every entry of '", key, "' must be even (RoPE rotates pairs), got ", d);
    total += d;
  }
  require(total == sum, "'", key, "' must sum to '", sum_key, "' (", sum, "), got sum ", total);
  return axes;
}

int64_t ConfigReader::width(const char* key_a, int64_t a, const char* key_b, int64_t b) const {
  require(a <= kMaxConfigDim / std::max<int64_t>(b, 1), "'", key_a, "' x '", key_b, "' = ", a, " x ", b,
          " is larger than the accepted width ", kMaxConfigDim);
  return a * b;
}

}  // namespace shardit::io
