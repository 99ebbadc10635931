#pragma once
// Qwen2.5-VL (transformers' models/qwen2_5_vl/modeling_qwen2_5_vl.py,
// Qwen2_5_VLForConditionalGeneration without lm_head): the Qwen decoder with q/k/v biases and no
// q/k norm and, when built with it, the vision tower (patch embedding, 2D RoPE, windowed and
// full-attention blocks, the patch merger) whose tokens replace the <|image_pad|> embeddings, with
// M-RoPE positions over text and images. Text-only M-RoPE has three equal position rows, so it
// is plain rotate-half RoPE with positions cumsum(mask) - 1. Qwen-Image's `text_encoder`: its
// pipelines take the last hidden state, keep the tokens under the mask and drop the template
// prefix. Members are named as the checkpoint keys.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/nn/conv.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/tokenizers/prompt_templates.h"

namespace shardit::models {

/// config.json of Qwen2_5_VLForConditionalGeneration: the text decoder's keys (top level, or under
/// `text_config` as newer transformers write them); rope_scaling "default" or "mrope";
/// attention_bias is always true (q/k/v biases).
Qwen3Config qwen2_5_vl_text_config_from_json(const nlohmann::json& json, const std::string& source);

/// config.json's `vision_config` (transformers' Qwen2_5_VLVisionConfig keys and defaults).
struct Qwen2_5_VLVisionConfig {
  int64_t depth = 32;
  int64_t hidden_size = 3584;
  nn::Activation hidden_act = nn::Activation::SiLU;
  int64_t intermediate_size = 3420;
  int64_t num_heads = 16;
  int64_t in_channels = 3;
  int64_t patch_size = 14;
  int64_t spatial_merge_size = 2;
  int64_t temporal_patch_size = 2;
  int64_t window_size = 112;
  int64_t out_hidden_size = 3584;
  std::vector<int64_t> fullatt_block_indexes = {7, 15, 23, 31};

  static Qwen2_5_VLVisionConfig from_json(const nlohmann::json& json, const std::string& source);
};

/// What the image path needs beyond the text decoder's config: the tower's config, the image
/// token ids, and M-RoPE's channel sections (rope_scaling.mrope_section: temporal, height, width
/// frequencies, summing to head_dim / 2).
struct Qwen2_5_VLImageConfig {
  Qwen2_5_VLVisionConfig vision;
  int64_t image_token_id = 151655;
  int64_t vision_start_token_id = 151652;
  std::vector<int64_t> mrope_section = {16, 24, 24};
};

/// Reads Qwen2_5_VLImageConfig from config.json (top level or `text_config` for the ids and
/// rope_scaling); an error names the missing `vision_config`.
Qwen2_5_VLImageConfig qwen2_5_vl_image_config_from_json(const nlohmann::json& json, const std::string& source,
                                                        const Qwen3Config& text);

/// Qwen2_5_VisionPatchEmbed: a Conv3d of stride = kernel = [temporal_patch, patch, patch], no bias.
class Qwen2_5_VisionPatchEmbed : public nn::Module {
 public:
  explicit Qwen2_5_VisionPatchEmbed(const Qwen2_5_VLVisionConfig& config);
  std::string type_name() const override { return "Qwen2_5_VisionPatchEmbed"; }
  /// pixel_values [N, C * tp * p * p] -> [N, hidden].
  at::Tensor forward(const at::Tensor& pixel_values);
  std::shared_ptr<nn::Conv3d> proj;

 private:
  Qwen2_5_VLVisionConfig config_;
};

/// Qwen2_5_VLVisionAttention: fused qkv (bias), per-head 2D RoPE, attention inside each segment
/// of `cu_seqlens`, proj (bias).
class Qwen2_5_VLVisionAttention : public nn::Module {
 public:
  explicit Qwen2_5_VLVisionAttention(const Qwen2_5_VLVisionConfig& config);
  std::string type_name() const override { return "Qwen2_5_VLVisionAttention"; }
  /// [N, D], cu_seqlens (segment bounds, from 0 to N) -> [N, D].
  at::Tensor forward(const at::Tensor& hidden_states, const std::vector<int64_t>& cu_seqlens,
                     const nn::RotaryEmbedding& rope);
  std::shared_ptr<nn::Linear> qkv, proj;

 private:
  int64_t head_dim_;
};

/// Qwen2_5_VLMLP with biases: down_proj(act(gate_proj(x)) * up_proj(x)).
class Qwen2_5_VLMLP : public nn::Module {
 public:
  explicit Qwen2_5_VLMLP(const Qwen2_5_VLVisionConfig& config);
  std::string type_name() const override { return "Qwen2_5_VLMLP"; }
  at::Tensor forward(const at::Tensor& x);
  std::shared_ptr<nn::Linear> gate_proj, up_proj, down_proj;

 private:
  nn::Activation activation_;
};

/// Qwen2_5_VLVisionBlock: x + attn(norm1(x)), then x + mlp(norm2(x)); RMSNorms of eps 1e-6.
class Qwen2_5_VLVisionBlock : public nn::Module {
 public:
  explicit Qwen2_5_VLVisionBlock(const Qwen2_5_VLVisionConfig& config);
  std::string type_name() const override { return "Qwen2_5_VLVisionBlock"; }
  at::Tensor forward(const at::Tensor& hidden_states, const std::vector<int64_t>& cu_seqlens,
                     const nn::RotaryEmbedding& rope);
  std::shared_ptr<nn::RMSNorm> norm1, norm2;
  std::shared_ptr<Qwen2_5_VLVisionAttention> attn;
  std::shared_ptr<Qwen2_5_VLMLP> mlp;
};

/// The merger's nn.Sequential(Linear, GELU, Linear): members `0` and `2` as the checkpoint keys.
class Qwen2_5_VLMergerMLP : public nn::Module {
 public:
  Qwen2_5_VLMergerMLP(int64_t hidden, int64_t out);
  std::string type_name() const override { return "Sequential"; }
  at::Tensor forward(const at::Tensor& x);
  std::shared_ptr<nn::Linear> fc1, fc2;  ///< `0`, `2`
};

/// Qwen2_5_VLPatchMerger: ln_q over each patch, then the merge_size² patches of a merge window
/// side by side through the MLP: [N, D] -> [N / merge², out_hidden_size].
class Qwen2_5_VLPatchMerger : public nn::Module {
 public:
  explicit Qwen2_5_VLPatchMerger(const Qwen2_5_VLVisionConfig& config);
  std::string type_name() const override { return "Qwen2_5_VLPatchMerger"; }
  at::Tensor forward(const at::Tensor& x);
  std::shared_ptr<nn::RMSNorm> ln_q;
  std::shared_ptr<Qwen2_5_VLMergerMLP> mlp;

 private:
  int64_t hidden_;
};

/// The vision tower's window layout for a set of images: the permutation of merged tokens into
/// windows of (window_size / merge / patch)² merged tokens, and the segment bounds in patches.
struct Qwen2_5_VLWindows {
  at::Tensor window_index;                 ///< [N / merge²] int64: merged token at each window position
  std::vector<int64_t> cu_window_seqlens;  ///< window bounds in patches, empty windows removed
  std::vector<int64_t> cu_seqlens;         ///< image bounds in patches (full attention)
};

/// Qwen2_5_VisionTransformerPretrainedModel: patch_embed, blocks (windowed attention except the
/// `fullatt_block_indexes`), merger; tokens reordered into windows before the blocks and back
/// after the merger.
class Qwen2_5_VisionTransformerPretrainedModel : public nn::Module {
 public:
  explicit Qwen2_5_VisionTransformerPretrainedModel(const Qwen2_5_VLVisionConfig& config);
  std::string type_name() const override { return "Qwen2_5_VisionTransformerPretrainedModel"; }
  /// pixel_values [N, C * tp * p * p] (the images' patches one after another), grid_thw [n, 3]
  /// (integer) -> [N / merge², out_hidden_size], each image's merged tokens in raster order.
  at::Tensor forward(const at::Tensor& pixel_values, const at::Tensor& grid_thw);
  /// get_window_index and the full-attention bounds for `grid_thw`.
  Qwen2_5_VLWindows windows(const at::Tensor& grid_thw) const;
  /// rot_pos_emb: per patch cat[h * inv_freq, w * inv_freq] twice (rotate-half layout), [N, head_dim].
  nn::RotaryEmbedding rotary(const at::Tensor& grid_thw) const;

  std::shared_ptr<Qwen2_5_VisionPatchEmbed> patch_embed;
  std::shared_ptr<nn::ModuleList<Qwen2_5_VLVisionBlock>> blocks;
  std::shared_ptr<Qwen2_5_VLPatchMerger> merger;
  const Qwen2_5_VLVisionConfig config;
};

/// transformers' get_rope_index for images: M-RoPE positions [3, B, S] (int64). Text runs count
/// on from the previous maximum + 1 on all three rows; an image's llm grid (t, h / merge,
/// w / merge) takes (t, row, col) offsets from the text before it; padding (mask 0) is 1.
at::Tensor qwen2_5_vl_rope_index(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                 const at::Tensor& image_grid_thw, int64_t image_token_id,
                                 int64_t vision_start_token_id, int64_t spatial_merge_size);

/// M-RoPE tables: rotate-half cos/sin [B, S, head_dim] whose channels take their angle from the
/// temporal, height or width row of `position_ids` [3, B, S] by `mrope_section` (repeated for
/// the second half).
nn::RotaryEmbedding qwen2_5_vl_mrope(const at::Tensor& position_ids, int64_t head_dim, double theta,
                                     const std::vector<int64_t>& mrope_section);

/// transformers' Qwen2_5_VLForConditionalGeneration: `model.*` (checkpoints written by
/// transformers >= 4.52 name it `model.language_model.*`; both are read) and, when built with an
/// image config, `visual.*` (or `model.visual.*`).
class Qwen2_5_VLForConditionalGeneration : public parallel::TensorParallelModule {
 public:
  explicit Qwen2_5_VLForConditionalGeneration(const Qwen3Config& config,
                                              std::optional<Qwen2_5_VLImageConfig> image_config = std::nullopt);
  std::string type_name() const override { return "Qwen2_5_VLForConditionalGeneration"; }
  const parallel::TpPlan& tp_plan() const override;
  parallel::ModelTraits traits() const override;

  /// input_ids (integer) [B, S], attention_mask (optional, [B, S], 1 = token). Positions are
  /// cumsum(mask) - 1 (1 at padding), arange(S) without a mask. Returns hidden states as
  /// Qwen3Model::forward; also emits position_ids [3, B, S].
  DecoderHiddenStates forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask,
                              const std::vector<int64_t>& hidden_states = {}, bool last_hidden_state = true);

  /// With images: input_ids [B, S] holding each image's expanded <|image_pad|> run,
  /// attention_mask [B, S], pixel_values and image_grid_thw as the processor gives them. The
  /// vision tower's tokens replace the pad embeddings in order (their count must equal the pads'),
  /// positions are qwen2_5_vl_rope_index's. Emits image_embeds and position_ids.
  DecoderHiddenStates forward_with_images(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                          const at::Tensor& pixel_values, const at::Tensor& image_grid_thw,
                                          const std::vector<int64_t>& hidden_states = {},
                                          bool last_hidden_state = true);

  at::ScalarType dtype() const { return model->norm->weight.scalar_type(); }
  at::Device device() const { return model->norm->weight.device(); }

  const Qwen3Config config;
  const std::optional<Qwen2_5_VLImageConfig> image_config;
  std::shared_ptr<Qwen3Model> model;
  std::shared_ptr<Qwen2_5_VisionTransformerPretrainedModel> visual;  ///< null without an image config

 private:
  std::vector<std::pair<std::string, std::vector<std::string>>> key_aliases_;
};

/// transformers' text-only position ids: cumsum(mask) - 1, 1 where the mask is 0. [B, S] int64.
at::Tensor qwen2_5_vl_text_position_ids(const at::Tensor& attention_mask);

/// Qwen-Image's prompt embeddings and their mask.
struct QwenImagePromptEmbeds {
  at::Tensor prompt_embeds;       ///< [B, L_max, D], zero rows after each prompt's end
  at::Tensor prompt_embeds_mask;  ///< [B, L_max] int64, 1 on the prompt's tokens
};

/// QwenImagePipeline._get_qwen_prompt_embeds after tokenizing (tokenizers::
/// encode_qwenimage_prompts): the last hidden state's rows under the mask, without the first
/// `drop_idx` (the template prefix), right-padded with zeros to the longest.
QwenImagePromptEmbeds qwenimage_prompt_embeds(Qwen2_5_VLForConditionalGeneration& text_encoder,
                                              const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                              int64_t drop_idx = tokenizers::kQwenImageDropIdx);

/// The post-processing alone: `last_hidden_state` [B, S, D] and its `attention_mask` [B, S].
QwenImagePromptEmbeds qwenimage_prompt_embeds_from_hidden(const at::Tensor& last_hidden_state,
                                                          const at::Tensor& attention_mask,
                                                          int64_t drop_idx = tokenizers::kQwenImageDropIdx);

}  // namespace shardit::models
