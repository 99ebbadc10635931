#pragma once
// transformers' CLIPTokenizer (the slow one FLUX.1 uses): ftfy-style clean-up, lower case, a
// regex pre-tokenizer and byte-level BPE with an end-of-word marker; BOS ... EOS around the text.
#include <string>
#include <unordered_map>

#include "shardit/tokenizers/added_tokens.h"
#include "shardit/tokenizers/bpe.h"
#include "shardit/tokenizers/regex.h"
#include "shardit/tokenizers/tokenizer.h"

namespace shardit::tokenizers {

class CLIPTokenizer final : public Tokenizer {
 public:
  /// Loads vocab.json and merges.txt (+ tokenizer_config.json / special_tokens_map.json).
  static CLIPTokenizer from_folder(const std::string& folder);

  std::vector<int64_t> encode_without_specials(std::string_view text) const override;
  std::vector<int64_t> add_special_tokens(std::vector<int64_t> ids) const override;
  int64_t num_special_tokens() const override { return 2; }
  int64_t pad_token_id() const override { return pad_id_; }
  const std::string& source() const override { return folder_; }

  int64_t bos_token_id() const { return bos_id_; }
  int64_t eos_token_id() const { return eos_id_; }
  /// tokenizer_config.json's model_max_length (77 for CLIP-L).
  int64_t model_max_length() const { return model_max_length_; }

 private:
  CLIPTokenizer();
  int64_t token_id(const std::string& token) const;

  std::string folder_;
  std::unordered_map<std::string, int64_t> vocab_;
  BpeRanks ranks_;
  Regex pattern_;
  AddedTokenMatcher added_;
  std::string bos_, eos_;
  int64_t bos_id_ = -1, eos_id_ = -1, pad_id_ = -1, unk_id_ = -1, model_max_length_ = 77;
};

}  // namespace shardit::tokenizers
