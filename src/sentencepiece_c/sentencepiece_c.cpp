#include "sentencepiece_c.h"

#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

char* copy_error(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out) std::memcpy(out, message.c_str(), message.size() + 1);
  return out;
}

}  // namespace

extern "C" {

void* shardit_spm_load(const char* path, char** error) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  const auto status = sp->Load(path);
  if (!status.ok()) {
    *error = copy_error(status.ToString());
    delete sp;
    return nullptr;
  }
  return sp;
}

void shardit_spm_free(void* handle) { delete static_cast<sentencepiece::SentencePieceProcessor*>(handle); }

int shardit_spm_encode(void* handle, const char* text, size_t size,
                       void (*emit)(void* user, const char* piece, size_t size), void* user, char** error) {
  std::vector<std::string> pieces;
  const auto status =
      static_cast<sentencepiece::SentencePieceProcessor*>(handle)->Encode(std::string_view(text, size), &pieces);
  if (!status.ok()) {
    *error = copy_error(status.ToString());
    return -1;
  }
  for (const auto& p : pieces) emit(user, p.data(), p.size());
  return 0;
}

int32_t shardit_spm_piece_to_id(void* handle, const char* piece, size_t size) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->PieceToId(std::string_view(piece, size));
}

void shardit_spm_id_to_piece(void* handle, int32_t id, void (*emit)(void* user, const char* piece, size_t size),
                             void* user) {
  const std::string& p = static_cast<sentencepiece::SentencePieceProcessor*>(handle)->IdToPiece(id);
  emit(user, p.data(), p.size());
}

int32_t shardit_spm_piece_size(void* handle) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->GetPieceSize();
}
}
