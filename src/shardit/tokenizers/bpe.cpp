#include "shardit/tokenizers/bpe.h"

#include <array>

#include "shardit/tokenizers/unicode.h"

namespace shardit::tokenizers {

namespace {

// 0xFF never occurs in valid UTF-8, so it separates the two halves of a pair unambiguously.
std::string pair_key(std::string_view left, std::string_view right) {
  std::string key;
  key.reserve(left.size() + right.size() + 1);
  key.append(left);
  key.push_back('\xff');
  key.append(right);
  return key;
}

// GPT-2's printable bytes, which stand for themselves in the byte-level alphabet.
bool is_printable_byte(int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); }

const std::array<std::string, 256>& byte_table() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      // Printable Latin-1 bytes stand for themselves; the others are shifted past U+00FF.
      append_utf8(t[b], is_printable_byte(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++));
    }
    return t;
  }();
  return table;
}

}  // namespace

std::string byte_level_encode(std::string_view bytes) {
  const auto& table = byte_table();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += table[b];
  return out;
}

bool BpeRanks::add(std::string_view left, std::string_view right) {
  const bool inserted = ranks_.emplace(pair_key(left, right), next_).second;
  ++next_;
  return inserted;
}

int BpeRanks::rank(std::string_view left, std::string_view right) const {
  const auto it = ranks_.find(pair_key(left, right));
  return it == ranks_.end() ? -1 : it->second;
}

std::vector<std::string> bpe_merge(std::vector<std::string> symbols, const BpeRanks& ranks) {
  while (symbols.size() > 1) {
    int best = -1;
    size_t best_at = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const int r = ranks.rank(symbols[i], symbols[i + 1]);
      if (r >= 0 && (best < 0 || r < best)) {
        best = r;
        best_at = i;
      }
    }
    if (best < 0) break;
    // Join every occurrence of the best pair, left to right (a merged symbol is not reused).
    const std::string left = symbols[best_at], right = symbols[best_at + 1];
    std::vector<std::string> merged;
    merged.reserve(symbols.size());
    for (size_t i = 0; i < symbols.size();) {
      if (i + 1 < symbols.size() && symbols[i] == left && symbols[i + 1] == right) {
        merged.push_back(left + right);
        i += 2;
      } else {
        merged.push_back(std::move(symbols[i]));
        ++i;
      }
    }
    symbols = std::move(merged);
  }
  return symbols;
}

std::vector<std::string> split_characters(std::string_view text) {
  std::vector<std::string> out;
  for (size_t i = 0; i < text.size();) {
    size_t n = 1;
    while (i + n < text.size() && (static_cast<unsigned char>(text[i + n]) & 0xC0) == 0x80) ++n;
    out.emplace_back(text.substr(i, n));
    i += n;
  }
  return out;
}

std::vector<std::string> byte_level_alphabet() {
  std::vector<std::string> alphabet;
  std::vector<std::string> others;
  const auto& table = byte_table();
  for (int b = 0; b < 256; ++b) {
    (is_printable_byte(b) ? alphabet : others).push_back(table[b]);
  }
  alphabet.insert(alphabet.end(), others.begin(), others.end());
  return alphabet;
}

std::vector<std::pair<std::string, std::string>> learn_bpe_merges(std::vector<BpeWord> words, size_t num_merges) {
  std::vector<std::pair<std::string, std::string>> merges;
  while (merges.size() < num_merges) {
    std::unordered_map<std::string, int64_t> counts;
    for (const BpeWord& word : words) {
      for (size_t i = 0; i + 1 < word.symbols.size(); ++i) counts[pair_key(word.symbols[i], word.symbols[i + 1])] += word.count;
    }
    // Ties: the smallest key in byte order, so the merges depend on nothing but the input.
    const std::pair<const std::string, int64_t>* best = nullptr;
    for (const auto& entry : counts) {
      if (!best || entry.second > best->second || (entry.second == best->second && entry.first < best->first)) {
        best = &entry;
      }
    }
    if (!best || best->second < 2) break;
    const size_t split = best->first.find('\xff');
    const std::string left = best->first.substr(0, split), right = best->first.substr(split + 1);
    for (BpeWord& word : words) {
      std::vector<std::string> joined;
      for (size_t i = 0; i < word.symbols.size(); ++i) {
        if (i + 1 < word.symbols.size() && word.symbols[i] == left && word.symbols[i + 1] == right) {
          joined.push_back(left + right);
          ++i;
        } else {
          joined.push_back(word.symbols[i]);
        }
      }
      word.symbols = std::move(joined);
    }
    merges.emplace_back(left, right);
  }
  return merges;
}

}  // namespace shardit::tokenizers
