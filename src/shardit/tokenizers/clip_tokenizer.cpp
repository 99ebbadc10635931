#include "shardit/tokenizers/clip_tokenizer.h"

#include <c10/util/Exception.h>

#include <fstream>

#include "shardit/tokenizers/text_cleaning.h"
#include "shardit/tokenizers/tokenizer_config.h"
#include "shardit/tokenizers/unicode.h"

namespace shardit::tokenizers {

namespace {

// CLIPTokenizer's pattern (with re.IGNORECASE). `\p{N}` is one digit at a time.
constexpr const char* kClipPattern =
    R"(<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+)";

// CLIP's vocabulary: 256 bytes, the same with "</w>", then the merges; the slow tokenizer reads
// at most this many merge lines.
constexpr size_t kMaxClipMerges = 49152 - 256 - 2;

}  // namespace

CLIPTokenizer::CLIPTokenizer() : pattern_(kClipPattern, "CLIPTokenizer", /*caseless=*/true) {}

CLIPTokenizer CLIPTokenizer::from_folder(const std::string& folder) {
  const std::string needed = "a CLIP tokenizer needs vocab.json and merges.txt";
  const std::string vocab_path = require_file(folder, "vocab.json", needed);
  const std::string merges_path = require_file(folder, "merges.txt", needed);
  CLIPTokenizer tok;
  tok.folder_ = folder;

  const nlohmann::json vocab = read_tokenizer_json(vocab_path);
  TORCH_CHECK(vocab.is_object() && !vocab.empty(), vocab_path, ": expected an object of token -> id");
  for (const auto& [token, id] : vocab.items()) {
    TORCH_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0, vocab_path, ": token '", token,
                "' has id ", id.dump(), ", expected a non-negative integer");
    tok.vocab_.emplace(token, id.get<int64_t>());
  }

  std::ifstream merges(merges_path);
  TORCH_CHECK(merges, merges_path, ": cannot open");
  std::string line;
  std::getline(merges, line);  // "#version: 0.2"
  size_t count = 0, line_number = 1;
  while (count < kMaxClipMerges && std::getline(merges, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    TORCH_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                    line.find(' ', space + 1) == std::string::npos,
                merges_path, ":", line_number, ": expected 'left right', got '", line, "'");
    tok.ranks_.add(line.substr(0, space), line.substr(space + 1));
    ++count;
  }
  // Without merges every word splits into single bytes: other ids, with no error anywhere.
  TORCH_CHECK(count > 0, merges_path, ": holds no merges (", line_number,
              " line(s)); a CLIP tokenizer's merges.txt lists one 'left right' pair per line after its '#version' "
              "line");

  const TokenizerConfig config = TokenizerConfig::from_folder(folder);
  tok.bos_ = config.special_token("bos_token").value_or("<|startoftext|>");
  tok.eos_ = config.special_token("eos_token").value_or("<|endoftext|>");
  const std::string pad = config.special_token("pad_token").value_or("<|endoftext|>");
  const std::string unk = config.special_token("unk_token").value_or("<|endoftext|>");
  std::vector<AddedToken> added = config.added_tokens_decoder();
  for (const std::string& special : {tok.bos_, tok.eos_, pad, unk}) {
    const auto it = tok.vocab_.find(special);
    TORCH_CHECK(it != tok.vocab_.end(), vocab_path, ": special token '", special, "' is not in the vocabulary");
    bool listed = false;
    for (const auto& a : added) listed = listed || a.content == special;
    if (!listed) added.push_back(AddedToken{special, it->second, false, false, true, true});
  }
  tok.added_ = AddedTokenMatcher(std::move(added), is_python_space);
  tok.bos_id_ = tok.vocab_.at(tok.bos_);
  tok.eos_id_ = tok.vocab_.at(tok.eos_);
  tok.pad_id_ = tok.vocab_.at(pad);
  tok.unk_id_ = tok.vocab_.at(unk);
  tok.model_max_length_ = config.value<int64_t>("model_max_length", 77);
  return tok;
}

int64_t CLIPTokenizer::token_id(const std::string& token) const {
  const auto it = vocab_.find(token);
  return it == vocab_.end() ? unk_id_ : it->second;
}

std::vector<int64_t> CLIPTokenizer::encode_without_specials(std::string_view raw) const {
  std::vector<int64_t> ids;
  for (const TextPiece& piece : added_.split(valid_utf8(raw))) {
    if (piece.id >= 0) {
      ids.push_back(piece.id);
      continue;
    }
    const std::string text = to_lower(whitespace_clean(fix_text(piece.text)));
    for (const auto& [begin, end] : pattern_.find_all(text)) {
      const std::string word = byte_level_encode(std::string_view(text).substr(begin, end - begin));
      // The slow tokenizer's BPE cache starts with BOS and EOS, so they pass through whole.
      if (word == bos_ || word == eos_) {
        ids.push_back(token_id(word));
        continue;
      }
      std::vector<std::string> symbols = split_characters(word);
      symbols.back() += "</w>";
      for (const std::string& symbol : bpe_merge(std::move(symbols), ranks_)) ids.push_back(token_id(symbol));
    }
  }
  return ids;
}

std::vector<int64_t> CLIPTokenizer::add_special_tokens(std::vector<int64_t> ids) const {
  ids.insert(ids.begin(), bos_id_);
  ids.push_back(eos_id_);
  return ids;
}

}  // namespace shardit::tokenizers
