#pragma once
// Added (special) tokens: strings matched in the raw text before any model sees it, as
// transformers' added-token trie and the tokenizers library's AddedVocabulary do.
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace shardit::tokenizers {

/// One added token, with the flags of transformers' `AddedToken`.
struct AddedToken {
  std::string content;
  int64_t id = -1;
  bool lstrip = false;       ///< swallows the whitespace before it
  bool rstrip = false;       ///< swallows the whitespace after it
  bool normalized = false;   ///< matched after normalisation (tokenizer.json only)
  bool special = false;
};

/// Parses an added-token entry (`added_tokens_decoder` value or tokenizer.json `added_tokens`
/// item); errors name `source`.
AddedToken parse_added_token(const nlohmann::json& entry, int64_t id, const std::string& source);

/// A span of text: either plain text (id < 0) or one added token.
struct TextPiece {
  std::string text;
  int64_t id = -1;
};

/// Finds added tokens in text: leftmost match first, the longest at that position.
class AddedTokenMatcher {
 public:
  using SpacePredicate = bool (*)(char32_t);
  AddedTokenMatcher() = default;
  /// `is_space` decides what lstrip/rstrip swallow (Python's isspace for the slow tokenizers,
  /// White_Space for tokenizer.json).
  AddedTokenMatcher(std::vector<AddedToken> tokens, SpacePredicate is_space);

  /// `text` cut into plain pieces and added tokens; empty plain pieces are dropped.
  std::vector<TextPiece> split(std::string_view text) const;
  bool empty() const { return tokens_.empty(); }
  /// The id of the added token whose content is exactly `content`, or -1.
  int64_t id_of(std::string_view content) const;

 private:
  struct Node {
    std::map<unsigned char, int> next;
    int token = -1;  // index into tokens_ when a token ends here
  };
  std::vector<AddedToken> tokens_;
  std::vector<Node> trie_;
  SpacePredicate is_space_ = nullptr;
};

}  // namespace shardit::tokenizers
