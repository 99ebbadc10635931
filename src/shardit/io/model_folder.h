#pragma once
// diffusers-format model folders: model_index.json naming components, each component a folder
// with config.json and its safetensors weights (single or sharded).
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"

namespace shardit::io {

/// One component folder (e.g. `transformer/`): its parsed config.json and its weights.
struct ComponentFolder {
  std::string dir;
  std::string name;        ///< component name ("transformer"), or the folder name
  nlohmann::json config;   ///< config.json
  /// `_class_name` of the config (diffusers), else the single entry of `architectures`
  /// (transformers), or "" when neither is there.
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

/// Bounds shared by every model config: far above any released model, low enough that
/// products of them (weight shapes, byte sizes) cannot overflow 64 bits and that a model with
/// absurd sizes is refused before anything is built.
constexpr int64_t kMaxConfigLayers = 1024;       ///< per stack of blocks (FLUX.1: 19 + 38, Qwen-Image: 60)
constexpr int64_t kMaxConfigDim = int64_t{1} << 20;  ///< any width, head count or channel count

/// Pass [-kAnyFiniteNumber, kAnyFiniteNumber] to ConfigReader::number for a value that may be any
/// finite number (a VAE's scaling factor, a scheduler's shift); errors then say "a finite number".
constexpr double kAnyFiniteNumber = std::numeric_limits<double>::max();

/// The strict reader of a config.json object, used by every model config. Each value is checked
/// for type and range, and errors name the file and the key: 2.5 for an integer, "3" for a
/// number, null (except for keys that diffusers declares optional), and values out of range
/// (such as 2^63, a negative width, or 100000 layers) are refused rather than truncated,
/// wrapped or defaulted. An absent key takes the reference's default.
class ConfigReader {
 public:
  /// `source` is the file (config.json) named in errors; `config` must be a JSON object.
  ConfigReader(const nlohmann::json& config, std::string source);

  const std::string& source() const { return source_; }
  bool contains(const char* key) const { return config_.contains(key); }

  /// An integer in [min, max].
  int64_t integer(const char* key, int64_t fallback, int64_t min, int64_t max) const;
  /// An integer in [min, max], or nullopt when the key is absent or null (`Optional[int]` keys).
  std::optional<int64_t> optional_integer(const char* key, int64_t min, int64_t max) const;
  /// A finite number (integer or not) in [min, max].
  double number(const char* key, double fallback, double min, double max) const;
  /// A finite number in [min, max], or nullopt when the key is absent or null (`Optional[float]`
  /// keys).
  std::optional<double> optional_number(const char* key, double min, double max) const;
  bool boolean(const char* key, bool fallback) const;
  /// true or false, or nullopt when the key is absent or null (`Optional[bool]` keys).
  std::optional<bool> optional_boolean(const char* key) const;
  /// A string (an activation name, a projection kind).
  std::string string(const char* key, std::string fallback) const;
  /// A list of at most `max_count` integers, each in [min, max].
  std::vector<int64_t> integers(const char* key, std::vector<int64_t> fallback, int64_t min, int64_t max,
                                size_t max_count) const;
  /// integers(), or nullopt when the key is absent or null (`Optional[tuple[int, ...]]` keys).
  std::optional<std::vector<int64_t>> optional_integers(const char* key, int64_t min, int64_t max,
                                                        size_t max_count) const;
  /// A list of at most `max_count` finite numbers, each in [min, max].
  std::vector<double> numbers(const char* key, std::vector<double> fallback, double min, double max,
                              size_t max_count) const;
  /// A list of at most `max_count` booleans.
  std::vector<bool> booleans(const char* key, std::vector<bool> fallback, size_t max_count) const;
  /// A list of at most `max_count` strings (block types).
  std::vector<std::string> strings(const char* key, std::vector<std::string> fallback, size_t max_count) const;

  /// A list of positive even integers summing to `sum` (RoPE axes splitting a head dim), of
  /// exactly `count` entries when `count` > 0.
  std::vector<int64_t> rope_axes(const char* key, std::vector<int64_t> fallback, const char* sum_key, int64_t sum,
                                 size_t count = 0) const;
  /// `a` x `b` (already read from `key_a` and `key_b`), refused naming both keys when it exceeds
  /// kMaxConfigDim (e.g. num_attention_heads x attention_head_dim, the model width).
  int64_t width(const char* key_a, int64_t a, const char* key_b, int64_t b) const;

  /// Fails with "<source>: <message>" unless `ok`: the model-specific checks (a sum of keys, a
  /// divisibility) use it so that they name the file the same way.
  template <class... Args>
  void require(bool ok, const Args&... message) const {
    TORCH_CHECK(ok, source_, ": ", message...);
  }

 private:
  /// The value of `key`; nullptr when absent. null is refused naming the key.
  const nlohmann::json* find(const char* key, const char* expected) const;
  /// The value of `key`; nullptr when absent or null (the keys diffusers declares Optional).
  const nlohmann::json* find_optional(const char* key) const;
  /// The entries of the list at `value` (of `key`), at most `max_count`, each read by `entry`.
  template <class T, class Entry>
  std::vector<T> read_list(const char* key, const nlohmann::json& value, const char* expected, size_t max_count,
                           Entry entry) const;
  const nlohmann::json& config_;
  std::string source_;
};

}  // namespace shardit::io
