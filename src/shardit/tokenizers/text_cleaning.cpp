#include "shardit/tokenizers/text_cleaning.h"

#include <array>
#include <unordered_map>

#include "shardit/tokenizers/regex.h"
#include "shardit/tokenizers/unicode.h"

namespace shardit::tokenizers {

namespace {

// Windows-1252 for bytes 0x80-0x9F; ftfy's "sloppy" variant keeps the five undefined bytes.
constexpr std::array<char32_t, 32> kWindows1252High = {
    0x20AC, 0x0081, 0x201A, 0x0192, 0x201E, 0x2026, 0x2020, 0x2021, 0x02C6, 0x2030, 0x0160,
    0x2039, 0x0152, 0x008D, 0x017D, 0x008F, 0x0090, 0x2018, 0x2019, 0x201C, 0x201D, 0x2022,
    0x2013, 0x2014, 0x02DC, 0x2122, 0x0161, 0x203A, 0x0153, 0x009D, 0x017E, 0x0178};

std::u32string u32(const char* utf8) { return to_u32(utf8); }

const std::unordered_map<char32_t, std::u32string>& ligatures() {
  static const std::unordered_map<char32_t, std::u32string> map = {
      {0x0132, u32("IJ")},  {0x0133, u32("ij")},  {0x0149, u32("\u02BCn")}, {0x01F1, u32("DZ")},
      {0x01F2, u32("Dz")},  {0x01F3, u32("dz")},  {0x01C4, u32("D\u017D")}, {0x01C5, u32("D\u017E")},
      {0x01C6, u32("d\u017E")}, {0x01C7, u32("LJ")}, {0x01C8, u32("Lj")}, {0x01C9, u32("lj")},
      {0x01CA, u32("NJ")},  {0x01CB, u32("Nj")},  {0x01CC, u32("nj")},  {0xFB00, u32("ff")},
      {0xFB01, u32("fi")},  {0xFB02, u32("fl")},  {0xFB03, u32("ffi")}, {0xFB04, u32("ffl")},
      {0xFB05, u32("\u017Ft")}, {0xFB06, u32("st")}};
  return map;
}

// ftfy's WIDTH_MAP: U+3000 -> space, and U+FF01..U+FFEF -> their NFKC form where it differs.
const std::unordered_map<char32_t, std::u32string>& width_map() {
  static const std::unordered_map<char32_t, std::u32string> map = [] {
    std::unordered_map<char32_t, std::u32string> m = {{0x3000, U" "}};
    for (char32_t c = 0xFF01; c < 0xFFF0; ++c) {
      const std::string one = to_utf8(std::u32string(1, c));
      const std::string folded = normalize(one, NormalForm::NFKC);
      if (folded != one) m.emplace(c, to_u32(folded));
    }
    return m;
  }();
  return map;
}

bool is_removed_control(char32_t c) {
  return c <= 0x08 || c == 0x0B || (c >= 0x0E && c <= 0x1F) || c == 0x7F || (c >= 0x206A && c <= 0x206F) ||
         c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFC);
}

// The HTML entities ftfy decodes are html5's named ones that end in ';', plus numeric references.
// Only the named entities of XML and the most common typographic ones are known here.
const std::unordered_map<std::string, std::u32string>& named_entities() {
  static const std::unordered_map<std::string, std::u32string> map = {
      {"amp", U"&"},    {"lt", U"<"},     {"gt", U">"},     {"quot", U"\""},  {"apos", U"'"},
      {"nbsp", U"\u00A0"}, {"hellip", U"\u2026"}, {"mdash", U"\u2014"}, {"ndash", U"\u2013"},
      {"lsquo", U"\u2018"}, {"rsquo", U"\u2019"}, {"ldquo", U"\u201C"}, {"rdquo", U"\u201D"},
      {"copy", U"\u00A9"}, {"reg", U"\u00AE"}, {"trade", U"\u2122"}, {"deg", U"\u00B0"},
      {"AMP", U"&"},    {"LT", U"<"},     {"GT", U">"},     {"QUOT", U"\""}};
  return map;
}

bool is_alnum_ascii(char32_t c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// `&#?[0-9A-Za-z]{1,24};` replaced where it names a character.
std::u32string unescape_html(const std::u32string& text) {
  std::u32string out;
  for (size_t i = 0; i < text.size();) {
    if (text[i] == '&') {
      size_t j = i + 1;
      const bool numeric = j < text.size() && text[j] == '#';
      if (numeric) ++j;
      const size_t body = j;
      while (j < text.size() && j - body < 24 && is_alnum_ascii(text[j])) ++j;
      if (j > body && j < text.size() && text[j] == ';') {
        const std::string name(text.begin() + body, text.begin() + j);
        std::u32string replacement;
        if (numeric) {
          // html.unescape: &#NNN; or &#xHH;, invalid code points become U+FFFD.
          const bool hex = name[0] == 'x' || name[0] == 'X';
          const std::string digits = hex ? name.substr(1) : name;
          const bool ok = !digits.empty() && digits.find_first_not_of(hex ? "0123456789abcdefABCDEF" : "0123456789") ==
                                                 std::string::npos;
          if (ok && digits.size() <= 8) {
            const unsigned long value = std::stoul(digits, nullptr, hex ? 16 : 10);
            if (value >= 0x80 && value <= 0x9F) {
              replacement = std::u32string(1, kWindows1252High[value - 0x80]);
            } else if (value == 0 || (value >= 0xD800 && value <= 0xDFFF) || value > 0x10FFFF) {
              replacement = std::u32string(1, U'\uFFFD');
            } else {
              replacement = std::u32string(1, static_cast<char32_t>(value));
            }
          }
        } else if (const auto it = named_entities().find(name); it != named_entities().end()) {
          replacement = it->second;
        }
        if (!replacement.empty()) {
          out += replacement;
          i = j + 1;
          continue;
        }
      }
    }
    out.push_back(text[i++]);
  }
  return out;
}

// ESC [ (digits|;)* letter
std::u32string remove_terminal_escapes(const std::u32string& text) {
  std::u32string out;
  for (size_t i = 0; i < text.size();) {
    if (text[i] == 0x1B && i + 1 < text.size() && text[i + 1] == '[') {
      size_t j = i + 2;
      while (j < text.size() && ((text[j] >= '0' && text[j] <= '9') || text[j] == ';')) ++j;
      if (j < text.size() && ((text[j] >= 'a' && text[j] <= 'z') || (text[j] >= 'A' && text[j] <= 'Z'))) {
        i = j + 1;
        continue;
      }
    }
    out.push_back(text[i++]);
  }
  return out;
}

std::u32string fix_segment_once(std::u32string text, bool unescape) {
  if (unescape) text = unescape_html(text);
  std::u32string out;
  // fix_c1_controls, fix_latin_ligatures, fix_character_width, uncurl_quotes: per character.
  for (char32_t c : text) {
    if (c >= 0x80 && c <= 0x9F) c = kWindows1252High[c - 0x80];
    if (const auto it = ligatures().find(c); it != ligatures().end()) {
      out += it->second;
      continue;
    }
    if (const auto it = width_map().find(c); it != width_map().end()) {
      out += it->second;
      continue;
    }
    if (c == 0x02BC || (c >= 0x2018 && c <= 0x201B)) c = '\'';
    if (c >= 0x201C && c <= 0x201F) c = '"';
    out.push_back(c);
  }
  // fix_line_breaks
  text.clear();
  for (size_t i = 0; i < out.size(); ++i) {
    const char32_t c = out[i];
    if (c == '\r') {
      text.push_back('\n');
      if (i + 1 < out.size() && out[i + 1] == '\n') ++i;
    } else if (c == 0x2028 || c == 0x2029 || c == 0x85) {
      text.push_back('\n');
    } else {
      text.push_back(c);
    }
  }
  // Lone surrogates cannot occur in decoded UTF-8, so fix_surrogates has nothing to do.
  text = remove_terminal_escapes(text);
  out.clear();
  for (char32_t c : text) {
    if (!is_removed_control(c)) out.push_back(c);
  }
  return to_u32(normalize(to_utf8(out), NormalForm::NFC));
}

}  // namespace

std::string fix_text(std::string_view utf8) {
  const std::u32string text = to_u32(utf8);
  std::u32string result;
  bool unescape = true;
  // Segments end after each '\n'; once a segment has '<', HTML is left alone from there on.
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find(U'\n', pos);
    end = end == std::u32string::npos ? text.size() : end + 1;
    std::u32string segment = text.substr(pos, end - pos);
    if (segment.find(U'<') != std::u32string::npos) unescape = false;
    for (;;) {
      std::u32string fixed = fix_segment_once(segment, unescape);
      if (fixed == segment) break;
      segment = std::move(fixed);
    }
    result += segment;
    pos = end;
  }
  return to_utf8(result);
}

std::string whitespace_clean(std::string_view utf8) {
  std::u32string out;
  bool in_space = false;
  for (char32_t c : to_u32(utf8)) {
    if (is_python_space(c)) {
      in_space = true;
      continue;
    }
    if (in_space && !out.empty()) out.push_back(' ');
    in_space = false;
    out.push_back(c);
  }
  return to_utf8(out);
}

}  // namespace shardit::tokenizers
