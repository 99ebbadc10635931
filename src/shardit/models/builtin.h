#pragma once
// A built-in tiny model, so that the CLI and the quick start run on a fresh machine with no
// checkpoint: a diffusers FluxPipeline folder holding a small FluxTransformer2DModel and
// AutoencoderKL trained to draw simple scenes (tools/train_builtin_model.py; the transformer in two
// safetensors shards with an index, as diffusers saves large models), FLUX.1-dev's scheduler
// config, and FLUX.1's two text encoders with
// their tokenizers: a small random CLIPTextModel with a CLIPTokenizer (byte-level BPE whose merges
// are learned from a built-in English text) and a small random T5EncoderModel with a
// SentencePiece unigram model trained on the same text. Also one input case in the golden-data
// layout (inputs.safetensors + inputs.json) and random prompt embeddings for `--prompt-embeds`.
// Every file is the same, byte for byte, each time it is written.
#include <string>

namespace shardit::models {

struct BuiltinModelPaths {
  std::string pipeline;     ///< the folder with model_index.json
  std::string transformer;  ///< its transformer/ component
  std::string inputs;       ///< a case folder for `run-transformer --inputs`
  std::string prompt_embeds;  ///< a file for `generate --prompt-embeds`
};

/// Writes (or reuses, when already complete) the built-in tiny model under `root` (well under
/// two seconds).
BuiltinModelPaths write_builtin_model(const std::string& root);

/// The default location: `$TMPDIR/shardit-builtin-<version>-<weights' SHA-256 prefix>`.
std::string default_builtin_model_root();

/// The trained transformer and VAE the built-in model is written from: the build folder's copy of
/// src/shardit/models/builtin_weights.safetensors (configure unpacks the packed file there and
/// checks its SHA-256), at the path compiled into the program.
std::string builtin_weights_file();
/// That file's recorded SHA-256 (hex).
std::string builtin_weights_sha256();

}  // namespace shardit::models
