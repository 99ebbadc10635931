#pragma once
// UTF-8 and Unicode helpers for the tokenizers, backed by ICU: decoding with replacement,
// normalisation, Python-compatible lower-casing and the whitespace classes the references use.
#include <string>
#include <string_view>

namespace shardit::tokenizers {

/// `text` with every maximal invalid UTF-8 subsequence replaced by U+FFFD, as Python's
/// `bytes.decode("utf-8", errors="replace")` does. `replaced` (optional) reports whether any was.
std::string sanitize_utf8(std::string_view text, bool* replaced = nullptr);

/// Code points of valid UTF-8 (run `sanitize_utf8` first on untrusted text).
std::u32string to_u32(std::string_view utf8);
/// UTF-8 of code points.
std::string to_utf8(std::u32string_view text);
/// Appends one code point as UTF-8.
void append_utf8(std::string& out, char32_t c);

/// Unicode normalisation forms (unicodedata.normalize / the tokenizers normalizers).
enum class NormalForm { NFC, NFD, NFKC, NFKD };
/// `text` in normalisation form `form`.
std::string normalize(std::string_view utf8, NormalForm form);

/// Full default lower-case mapping, as Python's `str.lower()` ("İ" -> "i̇", final sigma).
std::string to_lower(std::string_view utf8);

/// Python's `str.isspace()` for one character (also what `re`'s `\s` matches on str).
bool is_python_space(char32_t c);
/// The Unicode White_Space property (Rust's `char::is_whitespace`).
bool is_white_space(char32_t c);

}  // namespace shardit::tokenizers
