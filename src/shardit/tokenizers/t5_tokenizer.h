#pragma once
// transformers' T5Tokenizer (legacy mode) over SentencePiece: added tokens (<extra_id_N>, </s>,
// <pad>, <unk>) split out first, SentencePiece on the rest, `</s>` appended unless already last.
#include <string>

#include "shardit/tokenizers/added_tokens.h"
#include "shardit/tokenizers/sentencepiece.h"
#include "shardit/tokenizers/tokenizer.h"

namespace shardit::tokenizers {

class T5Tokenizer final : public Tokenizer {
 public:
  /// Loads spiece.model (+ tokenizer_config.json / special_tokens_map.json).
  static T5Tokenizer from_folder(const std::string& folder);

  std::vector<int64_t> encode_without_specials(std::string_view text) const override;
  std::vector<int64_t> add_special_tokens(std::vector<int64_t> ids) const override;
  int64_t num_special_tokens() const override { return 1; }
  int64_t pad_token_id() const override { return pad_id_; }
  const std::string& source() const override { return folder_; }

  int64_t eos_token_id() const { return eos_id_; }

 private:
  T5Tokenizer(std::string folder, const std::string& model_path);
  std::string folder_;
  SentencePiece sp_;
  AddedTokenMatcher added_;
  int64_t eos_id_ = -1, pad_id_ = -1;
};

}  // namespace shardit::tokenizers
