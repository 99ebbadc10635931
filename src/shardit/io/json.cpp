#include "shardit/io/json.h"

#include <c10/util/Exception.h>

#include <set>
#include <vector>

#include "shardit/io/file.h"

namespace shardit::io {

namespace {

// quoted() without the surrounding double quotes, for messages that quote with '...'.
std::string unquoted(const std::string& text) {
  const std::string escaped = quoted(text);
  return escaped.substr(1, escaped.size() - 2);
}

// One pass over the bytes before parsing: the nesting depth (so nothing recursive ever sees a
// deeper document) and the keys of each object (nlohmann keeps the last of repeated keys
// silently). Grammar errors are left to the parser.
void check_structure(const char* text, size_t size, const std::string& label, const JsonLimits& limits,
                     const std::string& part) {
  const std::string whole = part.empty() ? std::string("file") : part;
  struct Level {
    bool object = false;
    bool expect_key = false;
    std::set<std::string> keys;
  };
  std::vector<Level> stack;
  std::string path;  // "a.b" of the enclosing keys, for the message
  std::vector<size_t> path_lengths;
  std::string last_key;
  for (size_t i = 0; i < size; ++i) {
    const char c = text[i];
    if (c == '"') {
      const size_t begin = i;
      bool escaped = false;
      for (++i; i < size; ++i) {
        if (text[i] == '\\') {
          escaped = true;
          ++i;
        } else if (text[i] == '"') {
          break;
        }
      }
      if (i >= size) return;  // unterminated: the parser reports it
      if (!stack.empty() && stack.back().object && stack.back().expect_key) {
        std::string key(text + begin + 1, i - begin - 1);
        if (escaped) {
          try {
            key = nlohmann::json::parse(text + begin, text + i + 1).get<std::string>();
          } catch (const nlohmann::json::exception&) {
            return;  // a bad escape: the parser reports it
          }
        }
        TORCH_CHECK(stack.back().keys.insert(key).second, label, ": ", whole, " lists '", unquoted(key), "' more than once",
                    path.empty() ? std::string() : " (in '" + unquoted(path) + "')",
                    "; a JSON object may name a key only once");
        stack.back().expect_key = false;
        last_key = std::move(key);
      }
    } else if (c == '{' || c == '[') {
      TORCH_CHECK(static_cast<int>(stack.size()) < limits.max_depth, label, ": ", whole, " nests JSON deeper than ",
                  limits.max_depth, " levels (at byte ", i, "); no file shardit reads is nested like this");
      path_lengths.push_back(path.size());
      if (!stack.empty() && stack.back().object) path += (path.empty() ? "" : ".") + last_key;
      stack.push_back(Level{c == '{', c == '{', {}});
    } else if (c == '}' || c == ']') {
      if (stack.empty()) return;
      stack.pop_back();
      path.resize(path_lengths.back());
      path_lengths.pop_back();
    } else if (c == ',') {
      if (!stack.empty() && stack.back().object) stack.back().expect_key = true;
    }
  }
}

}  // namespace

nlohmann::json parse_json(const char* text, size_t size, const std::string& label, const JsonLimits& limits,
                          const std::string& part) {
  TORCH_CHECK(size <= limits.max_bytes, label, ": ", part.empty() ? "JSON file" : part, " is ", size,
              " bytes, more than the limit of ", limits.max_bytes, " bytes");
  check_structure(text, size, label, limits, part);
  try {
    return nlohmann::json::parse(text, text + size);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, label, ": ", part.empty() ? "invalid JSON" : part + " is not valid JSON", " (", e.what(), ")");
  }
}

nlohmann::json read_json_file(const std::string& path, const JsonLimits& limits) {
  const std::string text = read_regular_file(path, limits.max_bytes);
  return parse_json(text.data(), text.size(), path, limits);
}

std::string quoted(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

std::string brief(const nlohmann::json& value) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

}  // namespace shardit::io
