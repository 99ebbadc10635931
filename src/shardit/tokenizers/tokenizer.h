#pragma once
// The tokenizer interface the text encoders and pipelines call: ids as transformers' tokenizers
// give them, with their truncation and padding rules.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace shardit::tokenizers {

/// transformers' `padding=` argument.
enum class Padding {
  None,       ///< padding=False
  Longest,    ///< padding=True: to the longest row of the batch
  MaxLength,  ///< padding="max_length"
};

/// One row of a tokenizer call: `input_ids` and `attention_mask` (1 on tokens, 0 on padding).
struct Encoding {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> attention_mask;
  /// How many tokens truncation removed (0 when none).
  int64_t truncated_tokens = 0;
};

/// A loaded tokenizer. Text is UTF-8; invalid bytes become U+FFFD (with a note on stderr).
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// Ids of `text` without the special tokens the tokenizer adds around a sequence
  /// (added tokens written in the text are still recognised).
  virtual std::vector<int64_t> encode_without_specials(std::string_view text) const = 0;
  /// `ids` with the sequence's special tokens (CLIP: BOS ... EOS; T5: ... </s>; Qwen: none).
  virtual std::vector<int64_t> add_special_tokens(std::vector<int64_t> ids) const = 0;
  /// How many tokens `add_special_tokens` adds (what truncation reserves).
  virtual int64_t num_special_tokens() const = 0;
  /// The configured pad token's id (error when the folder configures none).
  virtual int64_t pad_token_id() const = 0;
  /// Where the tokenizer came from (for messages).
  virtual const std::string& source() const = 0;
  /// transformers' `padding_side`: true when padding goes before the tokens ("left", as the
  /// folder's tokenizer_config.json says; Mistral's Tekken tokenizer), false for "right".
  virtual bool pads_left() const { return false; }

  /// `tokenizer(text).input_ids`: the ids with special tokens, no truncation.
  std::vector<int64_t> encode(std::string_view text) const;

  /// `tokenizer(text, max_length=max_length, truncation=True, padding=padding)`: truncation keeps
  /// the first tokens and the special tokens; a note on stderr says how many were dropped.
  Encoding operator()(std::string_view text, int64_t max_length, Padding padding) const;
  /// The same call on a batch (Padding::Longest pads to the longest row). With
  /// `add_special_tokens` false (transformers' add_special_tokens=False, what a processor passes
  /// when a chat template already wrote them) nothing is added and truncation keeps the first
  /// max_length tokens. Padding goes on the side pads_left() says.
  std::vector<Encoding> operator()(const std::vector<std::string>& texts, int64_t max_length,
                                   Padding padding, bool add_special_tokens = true) const;

 protected:
  /// `text` as valid UTF-8: invalid bytes become U+FFFD, with a note on stderr.
  std::string valid_utf8(std::string_view text) const;
};

/// The tokenizer families shardit loads.
enum class TokenizerKind {
  Clip,  ///< CLIPTokenizer: vocab.json + merges.txt
  T5,    ///< T5Tokenizer: spiece.model (SentencePiece)
  Qwen,  ///< byte-level BPE from tokenizer.json (Qwen2TokenizerFast, Mistral's Tekken as LlamaTokenizerFast)
};

/// Parses "clip" | "t5" | "qwen".
TokenizerKind parse_tokenizer_kind(const std::string& name);

/// The kind of tokenizer a folder holds, from its own files: tokenizer_config.json's
/// `tokenizer_class` when it names a CLIP or T5 tokenizer; else spiece.model (T5), tokenizer.json
/// (byte-level BPE), vocab.json + merges.txt (CLIP). An error naming the folder and the files
/// looked for when none is there.
TokenizerKind detect_tokenizer_kind(const std::string& folder);

/// Loads the tokenizer of `kind` from a tokenizer folder (`tokenizer/`, `tokenizer_2/`). A
/// missing file is an error naming it.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& folder, TokenizerKind kind);

}  // namespace shardit::tokenizers
