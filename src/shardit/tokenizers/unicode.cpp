#include "shardit/tokenizers/unicode.h"

#include <c10/util/Exception.h>
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>
#include <unicode/utf8.h>

#include <vector>

namespace shardit::tokenizers {

namespace {

icu::UnicodeString from_utf8(std::string_view utf8) {
  return icu::UnicodeString::fromUTF8(icu::StringPiece(utf8.data(), static_cast<int32_t>(utf8.size())));
}

std::string to_std(const icu::UnicodeString& s) {
  std::string out;
  s.toUTF8String(out);
  return out;
}

}  // namespace

std::string sanitize_utf8(std::string_view text, bool* replaced) {
  TORCH_CHECK(text.size() < (1u << 30), "text of ", text.size(), " bytes is too long to tokenize (limit 1 GiB)");
  const auto length = static_cast<int32_t>(text.size());
  // ICU's U8_NEXT follows the Unicode "maximal subpart" practice, like Python's decoder.
  std::string out;
  out.reserve(text.size());
  bool any = false;
  const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
  for (int32_t i = 0; i < length;) {
    UChar32 c;
    U8_NEXT(bytes, i, length, c);
    if (c < 0) {
      any = true;
      c = 0xFFFD;
    }
    append_utf8(out, static_cast<char32_t>(c));
  }
  if (replaced) *replaced = any;
  return out;
}

std::u32string to_u32(std::string_view utf8) {
  std::u32string out;
  out.reserve(utf8.size());
  const auto* bytes = reinterpret_cast<const uint8_t*>(utf8.data());
  const auto length = static_cast<int32_t>(utf8.size());
  for (int32_t i = 0; i < length;) {
    UChar32 c;
    U8_NEXT(bytes, i, length, c);
    out.push_back(static_cast<char32_t>(c < 0 ? 0xFFFD : c));
  }
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  uint8_t buffer[U8_MAX_LENGTH];
  int32_t n = 0;
  UBool error = false;
  U8_APPEND(buffer, n, U8_MAX_LENGTH, static_cast<UChar32>(c), error);
  TORCH_INTERNAL_ASSERT(!error, "not a code point: ", static_cast<uint32_t>(c));
  out.append(reinterpret_cast<const char*>(buffer), static_cast<size_t>(n));
}

std::string to_utf8(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : text) append_utf8(out, c);
  return out;
}

std::string normalize(std::string_view utf8, NormalForm form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* normalizer = nullptr;
  switch (form) {
    case NormalForm::NFC: normalizer = icu::Normalizer2::getNFCInstance(status); break;
    case NormalForm::NFD: normalizer = icu::Normalizer2::getNFDInstance(status); break;
    case NormalForm::NFKC: normalizer = icu::Normalizer2::getNFKCInstance(status); break;
    case NormalForm::NFKD: normalizer = icu::Normalizer2::getNFKDInstance(status); break;
  }
  TORCH_CHECK(U_SUCCESS(status) && normalizer, "ICU normaliser unavailable: ", u_errorName(status));
  const icu::UnicodeString result = normalizer->normalize(from_utf8(utf8), status);
  TORCH_CHECK(U_SUCCESS(status), "ICU normalisation failed: ", u_errorName(status));
  return to_std(result);
}

std::string to_lower(std::string_view utf8) {
  icu::UnicodeString s = from_utf8(utf8);
  s.toLower(icu::Locale::getRoot());
  return to_std(s);
}

bool is_python_space(char32_t c) {
  // CPython: bidirectional class WS, B or S, or general category Zs.
  const auto dir = u_charDirection(static_cast<UChar32>(c));
  return dir == U_WHITE_SPACE_NEUTRAL || dir == U_BLOCK_SEPARATOR || dir == U_SEGMENT_SEPARATOR ||
         u_charType(static_cast<UChar32>(c)) == U_SPACE_SEPARATOR;
}

bool is_white_space(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE);
}

}  // namespace shardit::tokenizers
