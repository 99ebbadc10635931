#pragma once
// A built-in tiny model, so that the CLI and the quick start run on a fresh machine with no
// checkpoint: a diffusers FluxPipeline folder holding a small FluxTransformer2DModel with seeded
// random weights (in two safetensors shards with an index, as diffusers saves large models), a
// small random AutoencoderKL, FLUX.1-dev's scheduler config, and FLUX.1's two text encoders with
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

/// The default location: `$TMPDIR/shardit-builtin-<version>`.
std::string default_builtin_model_root();

}  // namespace shardit::models
