#pragma once
// What diffusers' joint-stream ("MMDiT") transformers share, written once: FLUX.1, FLUX.2 and
// Qwen-Image check the image and text token streams together, split both along the sequence under
// context parallelism, run the double-stream blocks over the two streams, then (FLUX) the
// single-stream blocks over the joint [text; image] sequence, and end with the output head
// norm_out -> proj_out, gathered. A model derives from JointTransformer2DModel and writes only
// what differs: its config, blocks and embeddings, the middle of its forward (conditioning,
// embeddings, RoPE, in the reference's order), and its plans as data.
//
//   at::Tensor MyTransformer2DModel::forward(const MyTransformer2DModelInputs& inputs) {
//     SHARDIT_PROFILE_SCOPE("MyTransformer2DModel");
//     JointForward joint(*this, inputs.hidden_states, config.in_channels, inputs.encoder_hidden_states,
//                        config.joint_attention_dim);
//     at::Tensor hidden_states = x_embedder->forward(joint.to_model(joint.image_tokens));
//     ...  encoder_hidden_states, temb, rope: the model's own ...
//     run_transformer_blocks(joint, *transformer_blocks, hidden_states, encoder_hidden_states, temb, rope);
//     run_single_transformer_blocks(joint, *single_transformer_blocks, SingleBlockOutput::Joint, hidden_states,
//                                   encoder_hidden_states, temb, rope);
//     return output_head(joint, hidden_states, temb);
//   }
//
// The skeleton also runs the step caches (models/step_cache.h): a forward that starts with
// `if (auto predicted = predicted_output(inputs.hidden_states)) return *predicted;` gets
// TaylorSeer, and First-Block Cache decides after the first of run_transformer_blocks' blocks.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "shardit/io/safetensors.h"
#include "shardit/models/activation_model.h"
#include "shardit/models/lora_conventions.h"
#include "shardit/models/step_cache.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/nn/norms.h"
#include "shardit/parallel/context_parallel.h"
#include "shardit/parallel/plan.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::models {

class JointTransformer2DModel;

/// One forward of a joint-stream transformer, from its start: the weights checked loaded, both
/// token streams checked together (image tokens [B, N, in_channels], text tokens
/// [B, L, joint_attention_dim]) and split at the cp plan's points "hidden_states" and
/// "encoder_hidden_states". It must live for the whole forward: while it does, attention
/// exchanges keys and values through `cp` (without context parallelism every point is the
/// identity).
class JointForward {
 public:
  JointForward(JointTransformer2DModel& model, const at::Tensor& hidden_states, int64_t in_channels,
               const at::Tensor& encoder_hidden_states, int64_t joint_attention_dim);

  /// `t` in the model's dtype, on its device.
  at::Tensor to_model(const at::Tensor& t) const { return t.to(device, dtype); }
  /// A per-sample argument (timestep, guidance) as fp32 [B] on the model's device: one value per
  /// sample, or one for all.
  at::Tensor per_sample(const char* name, const at::Tensor& values) const;
  /// An optional per-sample argument: required when `expected` (the model embeds it), refused
  /// otherwise; fp32 [B] when given.
  std::optional<at::Tensor> optional_per_sample(const char* name, const std::optional<at::Tensor>& values,
                                                bool expected) const;
  /// The position ids of both streams, as the reference's `txt_ids` and `img_ids`: each
  /// [S, n_axes] or [B, S, n_axes] (all samples share positions: the first is used), checked
  /// against its stream's length, on the model's device and split like the stream's tokens at the
  /// cp points "txt_ids" and "img_ids". Returns {[L_local, n_axes], [N_local, n_axes]}.
  std::pair<at::Tensor, at::Tensor> position_ids(const at::Tensor& txt_ids, const at::Tensor& img_ids, size_t n_axes);

  std::string where;  ///< the model's name, for messages
  at::ScalarType dtype;  ///< the model's
  at::Device device;     ///< the model's
  int64_t batch = 0;      ///< B
  int64_t image_len = 0;  ///< N, before the split
  int64_t text_len = 0;   ///< L, before the split
  /// The model's context-parallel scope: its other points (position ids, masks, rotary tables)
  /// split here too, and output_head gathers through it.
  parallel::ContextParallelForward cp;
  at::Tensor image_tokens;  ///< this rank's share [B, N_local, in_channels], as given (dtype, device)
  at::Tensor text_tokens;   ///< this rank's share [B, L_local, joint_attention_dim], as given
  /// First-Block Cache skipped the blocks after the head: the image stream already holds the
  /// cached result, and the remaining block runs do nothing.
  bool rest_of_stack_skipped = false;
};

/// How the reference returns a single-stream block's output, which names its observation.
enum class SingleBlockOutput {
  Joint,    ///< the joint sequence, as "hidden_states" (FLUX.2)
  Streams,  ///< split back into "encoder_hidden_states" and "hidden_states" (FLUX.1)
};

/// The base of the joint-stream transformers: the skeleton's steps for their forwards, the
/// output head `norm_out` / `proj_out` (registered by the model, last, as the reference does, so
/// the checkpoint keys are unchanged), and the head-count constraint of tensor parallelism.
class JointTransformer2DModel : public parallel::TensorParallelModule {
 public:
  /// Heads are the unit of the attention split: a rank must hold whole heads.
  parallel::ModelTraits traits() const override;
  /// The Linears `--weights-dtype fp8|int8` leaves dense (ModelTraits::keep_high_precision),
  /// as module globs: the model's data, beside its tp_plan.
  virtual std::vector<std::string> high_precision_modules() const = 0;

  /// How many double-stream (transformer_blocks) and single-stream (single_transformer_blocks)
  /// blocks the stack has, in that order.
  struct BlockCounts {
    int64_t double_stream = 0;
    int64_t single_stream = 0;
  };
  virtual BlockCounts block_counts() const = 0;
  /// The live tensors of one step's blocks for the memory planner (models/memory_plan.h), read
  /// from the model's block code: the model's data, beside its plans.
  virtual StepModel step_model(const StepShape& shape) const = 0;
  /// One forward on the arguments stored in a case file (inputs.safetensors, named as the
  /// reference's keyword arguments; non-tensor ones in the inputs.json next to it): the model's
  /// `<Class>Inputs::from_file`. Returns the sample.
  virtual at::Tensor forward_from_file(const io::SafetensorsFile& inputs) = 0;
  /// How the family's LoRA files of other trainers (kohya, BFL/ai-toolkit, XLabs) name its Linears
  /// (models/lora_conventions.h).
  virtual const LoraKeyConventions& lora_conventions() const = 0;

  /// Caches work between the forwards of one generation (diffusers' enable_cache); checked
  /// against the model first (check_cache_config). Replaces a cache that was on.
  void enable_cache(const StepCacheConfig& config);
  void disable_cache() { cache_.reset(); }
  /// The cache on, or null: the pipeline resets it per generation, sets its context per CFG
  /// branch and reads its decisions.
  StepCache* step_cache() const { return cache_.get(); }
  /// Refuses a config this model cannot take, naming why: First-Block Cache needs a head block
  /// that is a double-stream block and at least one block after it.
  void check_cache_config(const StepCacheConfig& config) const;

  /// The dtype and device of the (loaded) parameters: the compute dtype, also when proj_out holds
  /// 8-bit or GGUF codes.
  at::ScalarType dtype() const { return proj_out->weight_dtype(); }
  at::Device device() const { return proj_out->weight.device(); }

  std::shared_ptr<nn::AdaLayerNormContinuous> norm_out;
  std::shared_ptr<nn::Linear> proj_out;

 protected:
  explicit JointTransformer2DModel(int64_t num_attention_heads) : num_attention_heads_(num_attention_heads) {}

  /// With TaylorSeer on, at the start of a forward of image tokens `hidden_states` [B, N, C]: the
  /// predicted output when this forward does not compute (return it; run nothing else), else
  /// nullopt.
  std::optional<at::Tensor> predicted_output(const at::Tensor& hidden_states);

  /// Runs the double-stream `blocks` in order, replacing both streams (hidden_states [B, N, D],
  /// encoder_hidden_states [B, L, D]) by each block's output: block.forward(hidden_states,
  /// encoder_hidden_states, conditioning...) returns {encoder_hidden_states, hidden_states}, as the
  /// reference's blocks. Emits "block.<path>.encoder_hidden_states" and ".hidden_states". The
  /// first block is the stack's head: with First-Block Cache on, the rest of the stack may be
  /// skipped after it (joint.rest_of_stack_skipped; the text stream is then the head's, which
  /// nothing after the stack reads).
  template <class Block, class... Conditioning>
  void run_transformer_blocks(JointForward& joint, nn::ModuleList<Block>& blocks, at::Tensor& hidden_states,
                              at::Tensor& encoder_hidden_states, const Conditioning&... conditioning) {
    bool head = true;
    for (auto& block : blocks) {
      const at::Tensor block_input = hidden_states;
      std::tie(encoder_hidden_states, hidden_states) =
          block->forward(hidden_states, encoder_hidden_states, conditioning...);
      emit_block_output(*block, encoder_hidden_states, hidden_states);
      if (head && !head_block_runs_stack(joint, block_input, hidden_states)) {
        joint.rest_of_stack_skipped = true;
        return;
      }
      head = false;
    }
  }

  /// Runs the single-stream `blocks` over the joint sequence [text; image] and leaves the image
  /// part in `hidden_states`: [B, N, D] and encoder_hidden_states [B, L, D] -> [B, N, D].
  /// block.forward(joint, conditioning...) returns the joint sequence; it is emitted per block as
  /// `output` says.
  template <class Block, class... Conditioning>
  void run_single_transformer_blocks(JointForward& joint, nn::ModuleList<Block>& blocks, SingleBlockOutput output,
                                     at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                     const Conditioning&... conditioning) {
    if (joint.rest_of_stack_skipped) return;
    const int64_t text_len = encoder_hidden_states.size(1);
    // [B, L + N, D]
    hidden_states = at::cat({encoder_hidden_states, hidden_states}, 1);
    for (auto& block : blocks) {
      hidden_states = block->forward(hidden_states, conditioning...);
      emit_single_block_output(*block, output, hidden_states, text_len);
    }
    // [B, N, D]
    hidden_states = hidden_states.slice(1, text_len);
  }

  /// norm_out(hidden_states, temb) then proj_out, gathered at the cp point "proj_out": image
  /// tokens [B, N, D], temb [B, D] -> the sample [B, N, patch_size^2 * out_channels]. Emits
  /// "norm_out.linear" and "norm_out". `hidden_states` is the stack's output: First-Block Cache
  /// keeps its tail residual, TaylorSeer its factors.
  at::Tensor output_head(JointForward& joint, const at::Tensor& hidden_states, const at::Tensor& temb);

 private:
  void emit_block_output(const nn::Module& block, const at::Tensor& encoder_hidden_states,
                         const at::Tensor& hidden_states) const;
  void emit_single_block_output(const nn::Module& block, SingleBlockOutput output, const at::Tensor& joint,
                                int64_t text_len) const;
  /// First-Block Cache's decision after the head block (input -> output, this rank's image
  /// tokens [B, N_local, D]): the means reduced over the sequence and agreed over the
  /// tensor-parallel group. True without First-Block Cache. On false, `output` holds the cached
  /// stack output.
  bool head_block_runs_stack(JointForward& joint, const at::Tensor& input, at::Tensor& output);

  std::unique_ptr<StepCache> cache_;

  int64_t num_attention_heads_;
};

/// A joint-stream model's cp plan: the skeleton's own points (the image and text tokens split
/// along the sequence, the sample gathered after proj_out) around `model_points`, the model's
/// other splits (position ids, masks, rotary tables), which its forward marks on
/// JointForward::cp.
parallel::CpPlan joint_cp_plan(const parallel::CpPlan& model_points);

}  // namespace shardit::models
