#pragma once
// A BPE tokenizer described by a tokenizers-library `tokenizer.json` (Qwen2TokenizerFast and the
// other byte-level BPE tokenizers): added tokens, normaliser, Split/ByteLevel pre-tokenizers,
// the BPE model and the post-processor's special tokens.
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardit/tokenizers/added_tokens.h"
#include "shardit/tokenizers/bpe.h"
#include "shardit/tokenizers/regex.h"
#include "shardit/tokenizers/tokenizer.h"
#include "shardit/tokenizers/unicode.h"

namespace shardit::tokenizers {

class TokenizerJson final : public Tokenizer {
 public:
  /// Loads tokenizer.json (+ tokenizer_config.json / special_tokens_map.json for the pad token
  /// and tokenizer_config.json's padding_side).
  /// Parts of the format shardit does not implement are errors naming the key.
  static TokenizerJson from_folder(const std::string& folder);

  std::vector<int64_t> encode_without_specials(std::string_view text) const override;
  std::vector<int64_t> add_special_tokens(std::vector<int64_t> ids) const override;
  int64_t num_special_tokens() const override;
  int64_t pad_token_id() const override;
  const std::string& source() const override { return source_; }
  bool pads_left() const override { return pads_left_; }

  /// The id of an added token or vocabulary entry, or -1.
  int64_t token_to_id(const std::string& token) const;

 private:
  struct SplitStep {
    Regex pattern;
  };
  void encode_pretoken(std::string_view word, std::vector<int64_t>& ids) const;

  std::string source_;
  std::vector<NormalForm> normalizers_;
  std::vector<SplitStep> splits_;  // applied in order, each "Isolated"
  bool byte_level_ = false;
  std::unordered_map<std::string, int64_t> vocab_;
  BpeRanks ranks_;
  bool ignore_merges_ = false;
  std::optional<int64_t> unk_id_;
  AddedTokenMatcher raw_added_, normalized_added_;
  std::unordered_map<std::string, int64_t> added_ids_;
  std::vector<int64_t> prefix_, suffix_;  // post-processor special tokens around the sequence
  std::optional<int64_t> pad_id_;
  bool pads_left_ = false;  // tokenizer_config.json padding_side "left"
};

}  // namespace shardit::tokenizers
