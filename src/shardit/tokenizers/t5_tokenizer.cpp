#include "shardit/tokenizers/t5_tokenizer.h"

#include <c10/util/Exception.h>

#include "shardit/tokenizers/tokenizer_config.h"
#include "shardit/tokenizers/unicode.h"

namespace shardit::tokenizers {

T5Tokenizer::T5Tokenizer(std::string folder, const std::string& model_path)
    : folder_(std::move(folder)), sp_(model_path) {}

T5Tokenizer T5Tokenizer::from_folder(const std::string& folder) {
  const std::string model_path = require_file(folder, "spiece.model", "a T5 tokenizer needs the SentencePiece model");
  T5Tokenizer tok(folder, model_path);

  const TokenizerConfig config = TokenizerConfig::from_folder(folder);
  // legacy=false changes how text after an added token starts; transformers treats a missing
  // key as legacy (with a warning), and FLUX.1's tokenizer_2 says legacy=true.
  TORCH_CHECK(config.value<bool>("legacy", true), folder,
              "/tokenizer_config.json: legacy=false T5 tokenization is not supported; set \"legacy\": true");
  const int64_t pieces = tok.sp_.piece_size();
  auto piece_id = [&](const std::string& role, const char* fallback) {
    const std::string token = config.special_token(role).value_or(fallback);
    const int64_t id = tok.sp_.piece_to_id(token);
    TORCH_CHECK(tok.sp_.id_to_piece(id) == token, model_path, ": special token '", token, "' (", role,
                ") is not a piece of the model");
    return std::pair<std::string, int64_t>{token, id};
  };
  const auto eos = piece_id("eos_token", "</s>");
  const auto pad = piece_id("pad_token", "<pad>");
  const auto unk = piece_id("unk_token", "<unk>");
  tok.eos_id_ = eos.second;
  tok.pad_id_ = pad.second;

  std::vector<AddedToken> added = config.added_tokens_decoder();
  if (added.empty()) {
    // Folders without added_tokens_decoder: T5Tokenizer's defaults.
    for (const auto& [token, id] : {eos, pad, unk}) added.push_back(AddedToken{token, id, false, false, false, true});
    const int64_t extra_ids = config.value<int64_t>("extra_ids", 100);
    for (int64_t i = 0; i < extra_ids; ++i) {
      added.push_back(AddedToken{"<extra_id_" + std::to_string(i) + ">", pieces - 1 + extra_ids - i, true, true,
                                 false, true});
    }
  }
  tok.added_ = AddedTokenMatcher(std::move(added), is_python_space);
  return tok;
}

std::vector<int64_t> T5Tokenizer::encode_without_specials(std::string_view raw) const {
  std::vector<int64_t> ids;
  std::vector<std::string> pieces;
  for (const TextPiece& piece : added_.split(valid_utf8(raw))) {
    if (piece.id >= 0) {
      ids.push_back(piece.id);
      continue;
    }
    pieces = sp_.encode(piece.text);
    // As T5Tokenizer: pieces are mapped to ids afterwards, added tokens first.
    for (const std::string& p : pieces) {
      const int64_t added_id = added_.id_of(p);
      ids.push_back(added_id >= 0 ? added_id : sp_.piece_to_id(p));
    }
  }
  return ids;
}

std::vector<int64_t> T5Tokenizer::add_special_tokens(std::vector<int64_t> ids) const {
  if (ids.empty() || ids.back() != eos_id_) ids.push_back(eos_id_);
  return ids;
}

}  // namespace shardit::tokenizers
