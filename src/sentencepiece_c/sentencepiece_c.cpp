#include "sentencepiece_c.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

char* copy_error(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out) std::memcpy(out, message.c_str(), message.size() + 1);
  return out;
}

// The sentences of a training call, in order.
class SentenceList : public sentencepiece::SentenceIterator {
 public:
  SentenceList(const char* const* sentences, const size_t* sizes, size_t count)
      : sentences_(sentences), sizes_(sizes), count_(count) {
    load();
  }
  bool done() const override { return index_ >= count_; }
  void Next() override {
    ++index_;
    load();
  }
  const std::string& value() const override { return current_; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  void load() {
    if (index_ < count_) current_.assign(sentences_[index_], sizes_[index_]);
  }
  const char* const* sentences_;
  const size_t* sizes_;
  size_t count_;
  size_t index_ = 0;
  std::string current_;
};

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

char* shardit_spm_train(const char* const* option_keys, const char* const* option_values, size_t num_options,
                        const char* const* sentences, const size_t* sentence_sizes, size_t num_sentences,
                        unsigned int seed, size_t* model_size, char** error) {
  std::unordered_map<std::string, std::string> options;
  for (size_t i = 0; i < num_options; ++i) options[option_keys[i]] = option_values[i];
  sentencepiece::SetRandomGeneratorSeed(seed);
  SentenceList list(sentences, sentence_sizes, num_sentences);
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(options, &list, &model);
  if (!status.ok()) {
    *error = copy_error(status.ToString());
    return nullptr;
  }
  char* out = static_cast<char*>(std::malloc(model.size()));
  if (!out) {
    *error = copy_error("out of memory");
    return nullptr;
  }
  std::memcpy(out, model.data(), model.size());
  *model_size = model.size();
  return out;
}
}
