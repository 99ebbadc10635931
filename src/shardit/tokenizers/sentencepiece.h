#pragma once
// SentencePiece, loaded as a module (see src/sentencepiece_c/sentencepiece_c.h for why).
#include <cstdint>
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

}  // namespace shardit::tokenizers
