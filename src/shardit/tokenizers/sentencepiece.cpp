#include "shardit/tokenizers/sentencepiece.h"

#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace shardit::tokenizers {

namespace {

using Emit = void (*)(void*, const char*, size_t);

// The module's functions (src/sentencepiece_c/sentencepiece_c.h).
struct Module {
  void* (*load)(const char*, char**) = nullptr;
  void (*free)(void*) = nullptr;
  int (*encode)(void*, const char*, size_t, Emit, void*, char**) = nullptr;
  int32_t (*piece_to_id)(void*, const char*, size_t) = nullptr;
  void (*id_to_piece)(void*, int32_t, Emit, void*) = nullptr;
  int32_t (*piece_size)(void*) = nullptr;
  char* (*train)(const char* const*, const char* const*, size_t, const char* const*, const size_t*, size_t,
                 unsigned int, size_t*, char**) = nullptr;
};

template <class F>
void bind(void* library, const char* name, F& target, const std::string& path) {
  target = reinterpret_cast<F>(dlsym(library, name));
  TORCH_CHECK(target, path, ": has no symbol ", name);
}

const Module& module() {
  static Module m;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("SHARDIT_SENTENCEPIECE_MODULE");
    const std::string path = env && *env ? env : SHARDIT_SENTENCEPIECE_MODULE;
    // RTLD_LOCAL | RTLD_DEEPBIND: SentencePiece keeps to its own protobuf copy and LibTorch's
    // libprotobuf keeps to its own.
    void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    TORCH_CHECK(library, "cannot load the SentencePiece module ", path, " (", dlerror(),
                "); build the shardit_sentencepiece_c target or set SHARDIT_SENTENCEPIECE_MODULE");
    Module loaded;
    bind(library, "shardit_spm_load", loaded.load, path);
    bind(library, "shardit_spm_free", loaded.free, path);
    bind(library, "shardit_spm_encode", loaded.encode, path);
    bind(library, "shardit_spm_piece_to_id", loaded.piece_to_id, path);
    bind(library, "shardit_spm_id_to_piece", loaded.id_to_piece, path);
    bind(library, "shardit_spm_piece_size", loaded.piece_size, path);
    bind(library, "shardit_spm_train", loaded.train, path);
    m = loaded;
  });
  return m;
}

std::string take_error(char* error) {
  std::string message = error ? error : "unknown error";
  std::free(error);
  return message;
}

}  // namespace

SentencePiece::SentencePiece(const std::string& model_path) : path_(model_path) {
  char* error = nullptr;
  handle_ = module().load(model_path.c_str(), &error);
  TORCH_CHECK(handle_, model_path, ": not a SentencePiece model (", take_error(error), ")");
}

SentencePiece::~SentencePiece() {
  if (handle_) module().free(handle_);
}

SentencePiece::SentencePiece(SentencePiece&& other) noexcept : handle_(other.handle_), path_(std::move(other.path_)) {
  other.handle_ = nullptr;
}

std::vector<std::string> SentencePiece::encode(std::string_view text) const {
  std::vector<std::string> pieces;
  char* error = nullptr;
  const Emit emit = [](void* user, const char* piece, size_t size) {
    static_cast<std::vector<std::string>*>(user)->emplace_back(piece, size);
  };
  TORCH_CHECK(module().encode(handle_, text.data(), text.size(), emit, &pieces, &error) == 0, path_,
              ": SentencePiece failed to encode: ", take_error(error));
  return pieces;
}

int64_t SentencePiece::piece_to_id(std::string_view piece) const {
  return module().piece_to_id(handle_, piece.data(), piece.size());
}

std::string SentencePiece::id_to_piece(int64_t id) const {
  std::string out;
  const Emit emit = [](void* user, const char* piece, size_t size) { static_cast<std::string*>(user)->assign(piece, size); };
  module().id_to_piece(handle_, static_cast<int32_t>(id), emit, &out);
  return out;
}

int64_t SentencePiece::piece_size() const { return module().piece_size(handle_); }

std::string train_sentencepiece(const std::vector<std::string>& sentences,
                                const std::map<std::string, std::string>& options, unsigned int seed) {
  std::vector<const char*> keys, values, texts;
  std::vector<size_t> sizes;
  for (const auto& [key, value] : options) {
    keys.push_back(key.c_str());
    values.push_back(value.c_str());
  }
  for (const std::string& sentence : sentences) {
    texts.push_back(sentence.data());
    sizes.push_back(sentence.size());
  }
  char* error = nullptr;
  size_t size = 0;
  char* model = module().train(keys.data(), values.data(), keys.size(), texts.data(), sizes.data(), texts.size(),
                               seed, &size, &error);
  TORCH_CHECK(model, "SentencePiece training failed: ", take_error(error));
  std::string out(model, size);
  std::free(model);
  return out;
}

}  // namespace shardit::tokenizers
