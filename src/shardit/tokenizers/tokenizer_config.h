#pragma once
// The JSON files a transformers tokenizer folder carries next to its model files:
// tokenizer_config.json and special_tokens_map.json.
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardit/tokenizers/added_tokens.h"

namespace shardit::tokenizers {

/// Path of `name` inside `folder`; an error naming the file (and `needed_for`) when it is missing.
std::string require_file(const std::string& folder, const std::string& name, const std::string& needed_for);

/// A tokenizer JSON file, read with size and nesting limits (errors name the file).
nlohmann::json read_tokenizer_json(const std::string& path);

/// tokenizer_config.json and special_tokens_map.json of a folder (each optional).
struct TokenizerConfig {
  std::string folder;
  nlohmann::json config = nlohmann::json::object();       ///< tokenizer_config.json
  nlohmann::json special_map = nlohmann::json::object();  ///< special_tokens_map.json

  static TokenizerConfig from_folder(const std::string& folder);
  /// A special token by role ("bos_token", "pad_token" ...): tokenizer_config.json first, then
  /// special_tokens_map.json; a string or an AddedToken object. nullopt when absent or null.
  std::optional<std::string> special_token(const std::string& role) const;
  /// `added_tokens_decoder` of tokenizer_config.json (empty when absent).
  std::vector<AddedToken> added_tokens_decoder() const;
  /// tokenizer_config.json's `key`, or `fallback`.
  template <class T>
  T value(const char* key, T fallback) const;
};

}  // namespace shardit::tokenizers
