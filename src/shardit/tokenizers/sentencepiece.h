#pragma once
// SentencePiece, loaded as a module (see src/sentencepiece_c/sentencepiece_c.h for why).
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace shardit::tokenizers {

/// A loaded SentencePiece model.
class SentencePiece {
 public:
  /// Loads `model_path` (errors name the file).
  explicit SentencePiece(const std::string& model_path);
  ~SentencePiece();
  SentencePiece(SentencePiece&& other) noexcept;
  SentencePiece& operator=(SentencePiece&&) = delete;
  SentencePiece(const SentencePiece&) = delete;

  /// `sp.encode(text, out_type=str)`.
  std::vector<std::string> encode(std::string_view text) const;
  int64_t piece_to_id(std::string_view piece) const;
  std::string id_to_piece(int64_t id) const;
  int64_t piece_size() const;

 private:
  void* handle_ = nullptr;
  std::string path_;
};

/// Trains a SentencePiece model on `sentences` (SentencePieceTrainer::Train, as `spm_train` with
/// `options` as its flags: {"model_type", "unigram"}, {"vocab_size", "600"} ...), with the
/// library's random generator seeded by `seed`. Returns the model file's bytes (a serialized
/// ModelProto, what `spiece.model` holds); an error carries the trainer's message.
std::string train_sentencepiece(const std::vector<std::string>& sentences,
                                const std::map<std::string, std::string>& options, unsigned int seed);

}  // namespace shardit::tokenizers
