#pragma once
// How a transformer class's LoRA files name its Linears in the formats other trainers write, and
// the family's rules for their alphas (what diffusers' loaders/lora_conversion_utils.py does per
// family): the model's data (JointTransformer2DModel::lora_conventions), read by the one converter
// of every format (lora_formats.h).
#include <map>
#include <string>
#include <vector>

namespace shardit::models {

/// Source names of one LoRA format -> the diffusers modules they train, in lora_up row order (a
/// fused source such as BFL's `img_attn_qkv` splits by rows into several modules).
using LoraModuleTable = std::map<std::string, std::vector<std::string>>;

struct LoraKeyConventions {
  std::string family;  ///< "FLUX.1", for messages
  /// BFL module names (`.` as `_`) inside `double_blocks.<i>` and `single_blocks.<i>`, and
  /// outside the blocks. All empty: kohya and BFL/ai-toolkit names are the model's own module
  /// paths (kohya's with `_` for `.`, found among the model's Linears).
  LoraModuleTable bfl_double_block;
  LoraModuleTable bfl_single_block;
  LoraModuleTable bfl_top_level;
  /// kohya sources that diffusers converts and then does not load (prefixes of the name after
  /// `lora_unet_`): skipped, and listed as skipped.
  std::vector<std::string> kohya_skipped_prefixes;
  /// XLabs sources (`double_blocks.<i>.processor.<source>`, `single_blocks.<i>.processor.<source>`);
  /// both empty: the family has no XLabs LoRAs.
  LoraModuleTable xlabs_double_block;
  LoraModuleTable xlabs_single_block;
  /// BFL/ai-toolkit files may already hold diffusers block names (`transformer_blocks.`,
  /// `single_transformer_blocks.`, and `sformer_blocks.` for `transformer_blocks.`).
  bool bfl_names_may_be_diffusers = false;
  /// A BFL/ai-toolkit file (not kohya) that carries alphas is refused, as diffusers refuses it.
  bool bfl_refuses_alpha = false;
  /// kohya or BFL layout with lora_A/lora_B factor names: diffusers drops their alphas (scale 1).
  bool lora_ab_names_drop_alpha = false;
  /// A kohya pair (lora_down/lora_up) without `.alpha` is refused: the family's kohya files give
  /// every module its alpha.
  bool kohya_requires_alpha = false;

  /// Whether kohya and BFL names are the model's own module paths (no BFL tables).
  bool names_are_module_paths() const {
    return bfl_double_block.empty() && bfl_single_block.empty() && bfl_top_level.empty();
  }
  bool has_xlabs() const { return !xlabs_double_block.empty() || !xlabs_single_block.empty(); }
};

}  // namespace shardit::models
