#pragma once
// Every JSON document shardit reads (configs, model_index.json, weight indexes, safetensors
// headers, inputs.json, tokenizer files) goes through parse_json: size and nesting depth are
// bounded before the parser runs, and a key given twice in one object is an error (a parser
// that keeps the last one would let a second entry hide the first).
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardit::io {

/// Bounds on an untrusted JSON document.
struct JsonLimits {
  /// Largest document accepted. The default fits every config, index and tokenizer file known
  /// (the largest tokenizer.json files are ~30 MB); safetensors headers use the format's 100 MB.
  uint64_t max_bytes = 64ull << 20;
  /// Deepest nesting of arrays and objects accepted (real files nest fewer than 10 levels).
  int max_depth = 64;
};

/// Parses `size` bytes at `text`; `label` (the file) names it in every error: too large, too
/// deep, a repeated key (named, with its path), or invalid JSON. `part` names the JSON inside a
/// larger file ("header" of a safetensors file); empty when the file is the JSON.
nlohmann::json parse_json(const char* text, size_t size, const std::string& label, const JsonLimits& limits = {},
                          const std::string& part = "");

/// Reads and parses the regular file `path` with parse_json (a FIFO, directory or missing file is
/// refused naming the path).
nlohmann::json read_json_file(const std::string& path, const JsonLimits& limits = {});

/// `text` as a quoted JSON string, control characters escaped: how user-supplied names (tensor
/// names, metadata) are shown, so that they cannot move the cursor, colour the terminal or
/// forge lines.
std::string quoted(const std::string& text);

/// A short one-line rendering of a JSON value for error messages (at most 60 characters, never a
/// whole document; invalid UTF-8 replaced).
std::string brief(const nlohmann::json& value);

}  // namespace shardit::io
