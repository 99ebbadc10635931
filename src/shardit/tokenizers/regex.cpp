#include "shardit/tokenizers/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <c10/util/Exception.h>
#include <pcre2.h>

namespace shardit::tokenizers {

struct Regex::Impl {
  pcre2_code* code = nullptr;
  std::string pattern;  ///< for messages
  std::string source;   ///< the file it came from
  ~Impl() {
    if (code) pcre2_code_free(code);
  }
};

Regex::Regex(const std::string& pattern, const std::string& source, bool caseless) : impl_(std::make_unique<Impl>()) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  uint32_t options = PCRE2_UTF | PCRE2_UCP;
  if (caseless) options |= PCRE2_CASELESS;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error,
                              &offset, nullptr);
  if (!impl_->code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    TORCH_CHECK(false, source, ": pre-tokenizer regex does not compile at offset ", offset, " (",
                reinterpret_cast<const char*>(message), "): ", pattern);
  }
  impl_->pattern = pattern;
  impl_->source = source;
  // JIT is an optimisation only; without it the interpreter gives the same matches.
  pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(impl_->code, nullptr), &pcre2_match_data_free);
  TORCH_CHECK(data, "PCRE2: out of memory");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    const int rc = pcre2_match(impl_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      // A pattern that backtracks catastrophically hits PCRE2's match or depth limit (-47, -53).
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      TORCH_CHECK(false, impl_->source, ": pre-tokenizer regex failed on a text of ", text.size(), " bytes (",
                  reinterpret_cast<const char*>(message), ", PCRE2 code ", rc,
                  "); the pattern backtracks too much or is not a tokenizer's: ", impl_->pattern.substr(0, 200));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      matches.emplace_back(begin, end);
      start = end;
    } else {
      // An empty match: step over one whole character.
      start = end + 1;
      while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
    }
  }
  return matches;
}

}  // namespace shardit::tokenizers
