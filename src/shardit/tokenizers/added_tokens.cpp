#include "shardit/tokenizers/added_tokens.h"

#include <c10/util/Exception.h>

#include "shardit/tokenizers/unicode.h"

namespace shardit::tokenizers {

namespace {

bool flag(const nlohmann::json& entry, const char* key, const std::string& source) {
  if (!entry.contains(key) || entry.at(key).is_null()) return false;
  TORCH_CHECK(entry.at(key).is_boolean(), source, ": added token flag '", key, "' is not a boolean: ",
              entry.at(key).dump());
  return entry.at(key).get<bool>();
}

// Byte length of the last character of valid UTF-8 `s`.
size_t last_char_size(std::string_view s) {
  size_t n = 1;
  while (n < s.size() && (static_cast<unsigned char>(s[s.size() - n]) & 0xC0) == 0x80) ++n;
  return n;
}

char32_t first_char(std::string_view s) { return to_u32(s.substr(0, std::min<size_t>(4, s.size())))[0]; }

}  // namespace

AddedToken parse_added_token(const nlohmann::json& entry, int64_t id, const std::string& source) {
  TORCH_CHECK(entry.is_object() && entry.contains("content") && entry.at("content").is_string(), source,
              ": added token ", id, " has no string 'content': ", entry.dump().substr(0, 200));
  AddedToken token;
  token.content = entry.at("content").get<std::string>();
  TORCH_CHECK(!token.content.empty(), source, ": added token ", id, " is empty");
  token.id = id;
  token.lstrip = flag(entry, "lstrip", source);
  token.rstrip = flag(entry, "rstrip", source);
  token.normalized = flag(entry, "normalized", source);
  token.special = flag(entry, "special", source);
  TORCH_CHECK(!flag(entry, "single_word", source), source, ": added token '", token.content,
              "' has single_word=true, which shardit does not support");
  return token;
}

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens, SpacePredicate is_space)
    : tokens_(std::move(tokens)), trie_(1), is_space_(is_space) {
  for (size_t t = 0; t < tokens_.size(); ++t) {
    int node = 0;
    for (unsigned char c : tokens_[t].content) {
      auto it = trie_[node].next.find(c);
      if (it == trie_[node].next.end()) {
        trie_.emplace_back();
        it = trie_[node].next.emplace(c, static_cast<int>(trie_.size() - 1)).first;
      }
      node = it->second;
    }
    // A repeated content keeps its first entry.
    if (trie_[node].token < 0) trie_[node].token = static_cast<int>(t);
  }
}

int64_t AddedTokenMatcher::id_of(std::string_view content) const {
  int node = 0;
  if (trie_.empty()) return -1;
  for (unsigned char c : content) {
    const auto it = trie_[node].next.find(c);
    if (it == trie_[node].next.end()) return -1;
    node = it->second;
  }
  return trie_[node].token < 0 ? -1 : tokens_[trie_[node].token].id;
}

std::vector<TextPiece> AddedTokenMatcher::split(std::string_view text) const {
  std::vector<TextPiece> pieces;
  std::string plain;
  auto flush = [&] {
    if (!plain.empty()) pieces.push_back({std::move(plain), -1});
    plain.clear();
  };
  size_t i = 0;
  while (i < text.size()) {
    int best = -1;
    size_t best_end = 0;
    if (!trie_.empty()) {
      int node = 0;
      for (size_t j = i; j < text.size(); ++j) {
        const auto it = trie_[node].next.find(static_cast<unsigned char>(text[j]));
        if (it == trie_[node].next.end()) break;
        node = it->second;
        if (trie_[node].token >= 0) {
          best = trie_[node].token;
          best_end = j + 1;
        }
      }
    }
    if (best < 0) {
      plain.push_back(text[i++]);
      continue;
    }
    const AddedToken& token = tokens_[best];
    if (token.lstrip) {
      while (!plain.empty()) {
        const size_t n = last_char_size(plain);
        if (!is_space_(first_char(std::string_view(plain).substr(plain.size() - n)))) break;
        plain.resize(plain.size() - n);
      }
    }
    flush();
    pieces.push_back({token.content, token.id});
    i = best_end;
    if (token.rstrip) {
      while (i < text.size()) {
        size_t n = 1;
        while (i + n < text.size() && (static_cast<unsigned char>(text[i + n]) & 0xC0) == 0x80) ++n;
        if (!is_space_(first_char(text.substr(i, n)))) break;
        i += n;
      }
    }
  }
  flush();
  return pieces;
}

}  // namespace shardit::tokenizers
