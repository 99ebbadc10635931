#pragma once
// A C interface to SentencePiece, built as a loadable module. Debian's libsentencepiece carries
// its own copy of protobuf-lite and exports it; in a process that also holds LibTorch's
// libprotobuf the two copies interpose each other and crash at start-up. shardit therefore loads
// this module with dlopen(RTLD_LOCAL | RTLD_DEEPBIND), so SentencePiece binds to its own copy.
#include <stddef.h>
#include <stdint.h>

extern "C" {

/// Loads a .model file; returns a handle, or null with `error` (malloc'd, caller frees) set.
void* shardit_spm_load(const char* path, char** error);
void shardit_spm_free(void* handle);
/// Encodes `text` into pieces; calls `emit(user, piece, size)` for each. Returns 0, or -1 with
/// `error` set.
int shardit_spm_encode(void* handle, const char* text, size_t size,
                       void (*emit)(void* user, const char* piece, size_t size), void* user, char** error);
int32_t shardit_spm_piece_to_id(void* handle, const char* piece, size_t size);
/// Writes the piece of `id` through `emit`.
void shardit_spm_id_to_piece(void* handle, int32_t id, void (*emit)(void* user, const char* piece, size_t size),
                             void* user);
int32_t shardit_spm_piece_size(void* handle);
/// Trains a model (SentencePieceTrainer::Train with `num_options` key/value pairs of trainer
/// flags, "vocab_size" -> "600") on `num_sentences` sentences, after seeding SentencePiece's random
/// generator with `seed`. Returns the serialized model proto (malloc'd, `model_size` bytes), or null
/// with `error` set.
char* shardit_spm_train(const char* const* option_keys, const char* const* option_values, size_t num_options,
                        const char* const* sentences, const size_t* sentence_sizes, size_t num_sentences,
                        unsigned int seed, size_t* model_size, char** error);
}
