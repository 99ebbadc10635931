#include "shardit/tokenizers/tokenizer.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "shardit/core/notes.h"
#include "shardit/tokenizers/clip_tokenizer.h"
#include "shardit/tokenizers/t5_tokenizer.h"
#include "shardit/tokenizers/tokenizer_config.h"
#include "shardit/tokenizers/tokenizer_json.h"
#include "shardit/tokenizers/unicode.h"

namespace shardit::tokenizers {

std::string Tokenizer::valid_utf8(std::string_view text) const {
  bool replaced = false;
  std::string out = sanitize_utf8(text, &replaced);
  if (replaced) {
    note(source() + ": the text is not valid UTF-8; invalid bytes were replaced by U+FFFD");
  }
  return out;
}

std::vector<int64_t> Tokenizer::encode(std::string_view text) const {
  return add_special_tokens(encode_without_specials(text));
}

Encoding Tokenizer::operator()(std::string_view text, int64_t max_length, Padding padding) const {
  return (*this)(std::vector<std::string>{std::string(text)}, max_length, padding).front();
}

std::vector<Encoding> Tokenizer::operator()(const std::vector<std::string>& texts, int64_t max_length,
                                            Padding padding, bool add_special_tokens) const {
  const int64_t reserved = add_special_tokens ? num_special_tokens() : 0;
  TORCH_CHECK(max_length > reserved, source(), ": max_length ", max_length, " leaves no room for text (the ",
              reserved, " special token(s) need ", reserved, "); use a larger max_length");
  std::vector<Encoding> rows;
  rows.reserve(texts.size());
  size_t longest = 0;
  for (const auto& text : texts) {
    std::vector<int64_t> ids = encode_without_specials(text);
    Encoding row;
    // As transformers: the special tokens are counted before truncation, then added back.
    const int64_t total = static_cast<int64_t>(ids.size()) + reserved;
    if (total > max_length) {
      row.truncated_tokens = total - max_length;
      ids.resize(ids.size() - static_cast<size_t>(row.truncated_tokens));
      note(source() + ": prompt has " + std::to_string(total) + " tokens, more than max_length " +
           std::to_string(max_length) + "; the last " + std::to_string(row.truncated_tokens) + " were dropped");
    }
    row.input_ids = add_special_tokens ? this->add_special_tokens(std::move(ids)) : std::move(ids);
    row.attention_mask.assign(row.input_ids.size(), 1);
    longest = std::max(longest, row.input_ids.size());
    rows.push_back(std::move(row));
  }
  if (padding == Padding::None) return rows;
  const size_t target = padding == Padding::MaxLength ? static_cast<size_t>(max_length) : longest;
  const int64_t pad = pad_token_id();
  const bool left = pads_left();
  for (auto& row : rows) {
    if (row.input_ids.size() >= target) continue;
    const size_t missing = target - row.input_ids.size();
    if (left) {
      row.input_ids.insert(row.input_ids.begin(), missing, pad);
      row.attention_mask.insert(row.attention_mask.begin(), missing, 0);
    } else {
      row.input_ids.resize(target, pad);
      row.attention_mask.resize(target, 0);
    }
  }
  return rows;
}

TokenizerKind parse_tokenizer_kind(const std::string& name) {
  if (name == "clip") return TokenizerKind::Clip;
  if (name == "t5") return TokenizerKind::T5;
  if (name == "qwen") return TokenizerKind::Qwen;
  TORCH_CHECK(false, "unknown tokenizer kind '", name, "' (expected clip, t5 or qwen)");
}

TokenizerKind detect_tokenizer_kind(const std::string& folder) {
  namespace fs = std::filesystem;
  TORCH_CHECK(fs::is_directory(folder), folder, ": not a tokenizer folder (no such directory)");
  const auto has = [&](const char* name) { return fs::is_regular_file(fs::path(folder) / name); };
  // The class the folder was saved with decides where the files alone are ambiguous (a T5 folder
  // also carries the fast tokenizer's tokenizer.json; the slow T5Tokenizer is the reference).
  if (has("tokenizer_config.json")) {
    const TokenizerConfig config = TokenizerConfig::from_folder(folder);
    const std::string tokenizer_class = config.value<std::string>("tokenizer_class", "");
    if (tokenizer_class.rfind("CLIPTokenizer", 0) == 0) return TokenizerKind::Clip;
    if (tokenizer_class.rfind("T5Tokenizer", 0) == 0) return TokenizerKind::T5;
  }
  if (has("spiece.model")) return TokenizerKind::T5;
  if (has("tokenizer.json")) return TokenizerKind::Qwen;
  if (has("vocab.json") && has("merges.txt")) return TokenizerKind::Clip;
  TORCH_CHECK(false, folder, ": no tokenizer files found (looked for spiece.model, tokenizer.json, vocab.json + ",
              "merges.txt); point at a diffusers tokenizer/ folder");
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& folder, TokenizerKind kind) {
  switch (kind) {
    case TokenizerKind::Clip: return std::make_unique<CLIPTokenizer>(CLIPTokenizer::from_folder(folder));
    case TokenizerKind::T5: return std::make_unique<T5Tokenizer>(T5Tokenizer::from_folder(folder));
    case TokenizerKind::Qwen: return std::make_unique<TokenizerJson>(TokenizerJson::from_folder(folder));
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled tokenizer kind");
}

}  // namespace shardit::tokenizers
