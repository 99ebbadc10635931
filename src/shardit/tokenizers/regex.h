#pragma once
// PCRE2 in UTF + Unicode-property mode, for the pre-tokenizer patterns of the BPE tokenizers.
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shardit::tokenizers {

/// A compiled pattern. `\s`, `\p{L}`, `\p{N}` and case-insensitivity follow Unicode.
class Regex {
 public:
  /// Compiles `pattern`; a bad pattern is an error naming `source` (the file it came from).
  Regex(const std::string& pattern, const std::string& source, bool caseless = false);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  /// Byte ranges [begin, end) of the successive non-overlapping matches in valid UTF-8 `text`.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardit::tokenizers
