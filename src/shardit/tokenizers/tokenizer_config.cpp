#include "shardit/tokenizers/tokenizer_config.h"

#include <c10/util/Exception.h>

#include <filesystem>

#include "shardit/io/json.h"
#include "shardit/io/model_folder.h"

namespace shardit::tokenizers {

namespace fs = std::filesystem;

namespace {

// Real tokenizer.json files reach tens of MiB (Qwen's is 11 MiB); a larger or deeper file is
// not a tokenizer.
constexpr std::uintmax_t kMaxJsonBytes = 256ull << 20;
constexpr int kMaxJsonDepth = 32;

}  // namespace

std::string require_file(const std::string& folder, const std::string& name, const std::string& needed_for) {
  TORCH_CHECK(fs::is_directory(folder), folder, ": tokenizer folder does not exist");
  const fs::path path = fs::path(folder) / name;
  TORCH_CHECK(fs::is_regular_file(path), folder, ": tokenizer folder has no ", name, " (", needed_for,
              "); point --tokenizer at the folder that holds it");
  return path.string();
}

nlohmann::json read_tokenizer_json(const std::string& path) {
  return io::read_json_file(path, io::JsonLimits{kMaxJsonBytes, kMaxJsonDepth});
}

TokenizerConfig TokenizerConfig::from_folder(const std::string& folder) {
  TokenizerConfig c;
  c.folder = folder;
  for (auto [name, target] : {std::pair{"tokenizer_config.json", &c.config},
                              std::pair{"special_tokens_map.json", &c.special_map}}) {
    const fs::path path = fs::path(folder) / name;
    if (!fs::exists(path)) continue;
    *target = read_tokenizer_json(path.string());
    TORCH_CHECK(target->is_object(), path.string(), ": expected a JSON object, got ", target->type_name());
  }
  return c;
}

std::optional<std::string> TokenizerConfig::special_token(const std::string& role) const {
  for (const auto* source : {&config, &special_map}) {
    const auto it = source->find(role);
    if (it == source->end() || it->is_null()) continue;
    if (it->is_string()) return it->get<std::string>();
    if (it->is_object() && it->contains("content") && it->at("content").is_string()) {
      return it->at("content").get<std::string>();
    }
    TORCH_CHECK(false, folder, ": '", role, "' is neither a string nor a token object: ", it->dump());
  }
  return std::nullopt;
}

std::vector<AddedToken> TokenizerConfig::added_tokens_decoder() const {
  std::vector<AddedToken> tokens;
  const auto it = config.find("added_tokens_decoder");
  if (it == config.end() || it->is_null()) return tokens;
  const std::string source = folder + "/tokenizer_config.json";
  TORCH_CHECK(it->is_object(), source, ": added_tokens_decoder is not an object");
  for (const auto& [key, entry] : it->items()) {
    int64_t id = -1;
    try {
      size_t used = 0;
      id = std::stoll(key, &used);
      TORCH_CHECK(used == key.size() && id >= 0, "");
    } catch (const std::exception&) {
      TORCH_CHECK(false, source, ": added_tokens_decoder key '", key, "' is not a token id");
    }
    tokens.push_back(parse_added_token(entry, id, source));
  }
  return tokens;
}

template <class T>
T TokenizerConfig::value(const char* key, T fallback) const {
  // Lenient as transformers is: tokenizer configs store e.g. model_max_length as a huge float.
  if (!config.contains(key) || config.at(key).is_null()) return fallback;
  try {
    return config.at(key).get<T>();
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, folder, "/tokenizer_config.json: key '", key, "' has an unexpected type (",
                config.at(key).dump(), "): ", e.what());
  }
}

template bool TokenizerConfig::value<bool>(const char*, bool) const;
template int64_t TokenizerConfig::value<int64_t>(const char*, int64_t) const;
template std::string TokenizerConfig::value<std::string>(const char*, std::string) const;

}  // namespace shardit::tokenizers
