// The checks of numeric options, on their text before CLI11 converts it: CLI11 2.1 reads integers
// with strtoull/strtoll (so "-1" becomes 2^64-1 for an unsigned option, "010" is octal and an
// overflow saturates) and prints its ranges with std::to_string (309 digits for a double's max).
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "apps/commands.h"

namespace shardit::apps {

namespace {

// "from 1 to 10000".
template <class T>
std::string range_words(T low, T high) {
  return fmt::format("from {} to {}", low, high);
}

// `text` parsed as a plain decimal integer of type T (no sign for unsigned, no base prefix, no
// leading zero, which CLI11 would read as octal, no spaces); false when it is not one or does not
// fit.
template <class T>
bool parse_decimal(const std::string& text, T& value) {
  if (text.empty() || (text[0] == '+')) return false;
  if (std::is_unsigned_v<T> && text[0] == '-') return false;
  const size_t first_digit = text[0] == '-' ? 1 : 0;
  if (text.size() > first_digit + 1 && text[first_digit] == '0') return false;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value, 10);
  return error == std::errc() && stop == end;
}

template <class T>
CLI::Validator integer_validator(T low, T high) {
  const std::string words = range_words(low, high);
  return CLI::Validator(
      [low, high, words](std::string& text) -> std::string {
        T value{};
        if (!parse_decimal(text, value) || value < low || value > high) {
          return fmt::format("must be an integer {}, got '{}'", words, text.substr(0, 40));
        }
        return "";
      },
      "INT " + words);
}

}  // namespace

CLI::Validator integer_in(int64_t low, int64_t high) { return integer_validator<int64_t>(low, high); }

CLI::Validator unsigned_in(uint64_t low, uint64_t high) { return integer_validator<uint64_t>(low, high); }

bool parse_decimal_number(const std::string& text, double& value) {
  // [-]digits[.digits][e[+-]digits], or [-].digits...: what strtod reads, less its hexadecimal
  // floats ("0x10" is 16), "inf", "nan", leading spaces and '+'.
  size_t at = text.size() > 0 && text[0] == '-' ? 1 : 0;
  const auto digits = [&text, &at] {
    const size_t start = at;
    while (at < text.size() && text[at] >= '0' && text[at] <= '9') ++at;
    return at - start;
  };
  size_t mantissa = digits();
  if (at < text.size() && text[at] == '.') {
    ++at;
    mantissa += digits();
  }
  if (mantissa == 0) return false;
  if (at < text.size() && (text[at] == 'e' || text[at] == 'E')) {
    ++at;
    if (at < text.size() && (text[at] == '-' || text[at] == '+')) ++at;
    if (digits() == 0) return false;
  }
  if (at != text.size()) return false;
  value = std::strtod(text.c_str(), nullptr);
  return std::isfinite(value);
}

CLI::Validator number_in(double low, double high) {
  const std::string words = fmt::format("from {:g} to {:g}", low, high);
  return CLI::Validator(
      [low, high, words](std::string& text) -> std::string {
        double value = 0;
        if (!parse_decimal_number(text, value) || value < low || value > high) {
          return fmt::format("must be a number {}, got '{}'", words, text.substr(0, 40));
        }
        return "";
      },
      "NUMBER " + words);
}

}  // namespace shardit::apps
