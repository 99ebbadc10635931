#pragma once
// Single-file transformers: the files model makers and ComfyUI publish (Black Forest Labs' own key
// names with fused projections, ComfyUI's `model.diffusion_model.` prefix, FP8 with per-tensor
// `scale_weight`) read as a model's checkpoint. Each family declares its layouts as data beside its
// model (diffusers' `convert_*_checkpoint_to_diffusers` as tables); its registry row carries them.
// The file is mapped (io::KeyMapping), never converted in memory: a fused tensor's rows are read
// per rank, as the model's tensors of a diffusers folder are.
#include <string>
#include <vector>

#include "shardit/io/safetensors.h"
#include "shardit/nn/module.h"

namespace shardit::models {

/// The file's module `source` holds the model's modules `targets`, their rows (dim 0 of each
/// tensor: weight, bias, per-row scales) one after the other in this order; each target's row
/// count is the model's. A `*` stands for a block index, the same in `source` and `targets`
/// ("double_blocks.*.img_attn.qkv" -> "transformer_blocks.*.attn.to_q", "...to_k", "...to_v").
/// A per-tensor scale of the source ([] or [1]) applies to every target.
struct SingleFileRule {
  std::string source;
  std::vector<std::string> targets;
  /// The file's name for the targets' `weight` (BFL's RMSNorms store `scale`).
  std::string weight_name = "weight";
  /// One target whose two halves the file stores swapped (BFL's final modulation is
  /// [shift, scale]; diffusers' AdaLayerNormContinuous reads [scale, shift]).
  bool swapped_halves = false;
};

/// How one family's single files name the transformer's tensors.
struct SingleFileLayout {
  std::string name;                   ///< "BFL", "ComfyUI", "diffusers": for messages
  std::vector<std::string> prefixes;  ///< taken off every key, tried in order ("" = none)
  /// Keys (after the prefix) that identify the layout: all present. Also what an error lists
  /// as expected.
  std::vector<std::string> markers;
  /// Renamed and split modules; a tensor no rule covers keeps its own name.
  std::vector<SingleFileRule> rules;
  /// Keys (after the prefix) that carry no weight (ComfyUI's `scaled_fp8` marker of FP8 files).
  std::vector<std::string> ignored;
};

/// ComfyUI's marker tensor in "fp8 scaled" files (its dtype says which FP8 format the weights use).
inline const char* const kComfyScaledFp8Marker = "scaled_fp8";

/// The layout of `file` among `layouts` (the first whose markers are all present under one of its
/// prefixes), or nullptr; `prefix` receives the prefix it matched under.
const SingleFileLayout* detect_single_file_layout(const io::Checkpoint& file,
                                                  const std::vector<SingleFileLayout>& layouts, std::string* prefix);

/// The mapping that reads `model`'s tensors from `file` in `layout` (under `prefix`): every tensor
/// the model declares (and the scales beside its 8-bit weights) -> its pieces of the file's
/// tensors. A file tensor no rule or model name uses keeps its name (so the loader reports it as
/// unexpected), but the layout's ignored keys. Errors, before anything is read, name the file and
/// list the tensors of the layout that are missing, or a fused tensor whose rows do not add up.
io::KeyMapping single_file_mapping(const io::Checkpoint& file, const SingleFileLayout& layout,
                                   const std::string& prefix, nn::Module& model);

}  // namespace shardit::models
