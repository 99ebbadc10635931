#include "shardit/models/joint_transformer.h"
#include "shardit/nn/inputs.h"

namespace shardit::models {

JointForward::JointForward(JointTransformer2DModel& model, const at::Tensor& hidden_states, int64_t in_channels,
                           const at::Tensor& encoder_hidden_states, int64_t joint_attention_dim)
    : where(model.type_name()),
      dtype(model.proj_out->weight_dtype()),  // the compute dtype, also when proj_out is 8-bit
      device(model.device()),
      cp(model.context_parallel_forward()) {
  model.check_loaded(where);
  const nn::JointStreams streams =
      nn::check_joint_streams(where, hidden_states, in_channels, encoder_hidden_states, joint_attention_dim);
  batch = streams.batch;
  image_len = streams.image_len;
  text_len = streams.text_len;
  // Under context parallelism each rank keeps its share of the tokens from here on:
  // [B, N_local, C], [B, L_local, C_text].
  image_tokens = cp.point("hidden_states", hidden_states);
  text_tokens = cp.point("encoder_hidden_states", encoder_hidden_states);
}

at::Tensor JointForward::per_sample(const char* name, const at::Tensor& values) const {
  return nn::per_sample_values(where, name, values, batch, device);
}

std::optional<at::Tensor> JointForward::optional_per_sample(const char* name, const std::optional<at::Tensor>& values,
                                                            bool expected) const {
  return nn::optional_per_sample_values(where, name, values, expected, batch, device);
}

std::pair<at::Tensor, at::Tensor> JointForward::position_ids(const at::Tensor& txt_ids, const at::Tensor& img_ids,
                                                             size_t n_axes) {
  const auto axes = static_cast<int64_t>(n_axes);
  const auto ids_2d = [&](const char* name, const at::Tensor& ids, int64_t len) {
    const size_t batched = nn::check_shape_any(where, name, ids, {{"B", {"S", len}, axes}, {{"S", len}, axes}});
    // [S, n_axes]
    return cp.point(name, (batched == 0 ? ids.select(0, 0) : ids).to(device));
  };
  const at::Tensor text = ids_2d("txt_ids", txt_ids, text_len);
  return {text, ids_2d("img_ids", img_ids, image_len)};
}

parallel::ModelTraits JointTransformer2DModel::traits() const {
  // Heads are the unit of the attention split: a rank must hold whole heads.
  parallel::ModelTraits traits;
  traits.divisors = {{"num_attention_heads", num_attention_heads_}};
  traits.keep_high_precision = high_precision_modules();
  return traits;
}

void JointTransformer2DModel::check_cache_config(const StepCacheConfig& config) const {
  if (!std::holds_alternative<FirstBlockCacheConfig>(config.method)) return;
  const BlockCounts blocks = block_counts();
  TORCH_CHECK(blocks.double_stream >= 1 && blocks.double_stream + blocks.single_stream >= 2, type_name(),
              ": --cache ", config.to_string(), " needs a double-stream head block (transformer_blocks.0) and at "
              "least one block after it, but this model has ", blocks.double_stream, " transformer_blocks and ",
              blocks.single_stream, " single_transformer_blocks; use taylorseer_lite, or no cache");
}

void JointTransformer2DModel::enable_cache(const StepCacheConfig& config) {
  check_cache_config(config);
  cache_ = std::make_unique<StepCache>(config);
}

std::optional<at::Tensor> JointTransformer2DModel::predicted_output(const at::Tensor& hidden_states) {
  // A malformed input is left to JointForward's checks, which name it.
  if (!cache_ || !hidden_states.defined() || hidden_states.dim() != 3) return std::nullopt;
  return cache_->begin_forward(hidden_states.size(0), hidden_states.size(1));
}

bool JointTransformer2DModel::head_block_runs_stack(JointForward& joint, const at::Tensor& input,
                                                    at::Tensor& output) {
  if (!cache_ || !cache_->first_block()) return true;
  // r, this rank's tokens: [B, N_local, D]
  const at::Tensor residual = output - input;
  at::Tensor sums = cache_->head_residual_sums(residual);  // [2, N_local], or none on the first forward
  if (sums.defined()) {
    // Sums over the whole sequence, not means of the ranks' means: [2].
    sums = joint.cp.sum_over_sequence("hidden_states", sums);
    // Replicated over the tensor-parallel ranks: the same in exact arithmetic, made the same bits.
    agree(sums);
  }
  return cache_->head_decides(sums, residual, output);
}

at::Tensor JointTransformer2DModel::output_head(JointForward& joint, const at::Tensor& hidden_states,
                                                const at::Tensor& temb) {
  if (cache_ && cache_->first_block() && !joint.rest_of_stack_skipped) cache_->end_of_stack(hidden_states);
  // hidden_states [B, N, D], temb [B, D]
  at::Tensor norm_out_emb;
  const at::Tensor normed = norm_out->forward(hidden_states, temb, observed() ? &norm_out_emb : nullptr);
  emit("norm_out.linear", norm_out_emb);
  emit("norm_out", normed);
  // [B, N, patch^2 * out_channels]
  at::Tensor sample = joint.cp.point("proj_out", proj_out->forward(normed));
  if (cache_ && cache_->taylorseer()) cache_->computed_output(sample);
  return sample;
}

void JointTransformer2DModel::emit_block_output(const nn::Module& block, const at::Tensor& encoder_hidden_states,
                                                const at::Tensor& hidden_states) const {
  if (!observed()) return;
  emit("block." + block.path() + ".encoder_hidden_states", encoder_hidden_states);
  emit("block." + block.path() + ".hidden_states", hidden_states);
}

void JointTransformer2DModel::emit_single_block_output(const nn::Module& block, SingleBlockOutput output,
                                                       const at::Tensor& joint, int64_t text_len) const {
  if (!observed()) return;
  switch (output) {
    case SingleBlockOutput::Joint:
      emit("block." + block.path() + ".hidden_states", joint);
      return;
    case SingleBlockOutput::Streams:
      // [B, L, D] and [B, N, D]
      emit_block_output(block, joint.slice(1, 0, text_len), joint.slice(1, text_len));
      return;
  }
}

parallel::CpPlan joint_cp_plan(const parallel::CpPlan& model_points) {
  using parallel::CpAction;
  using parallel::SequenceStream;
  // The points JointForward and output_head mark: both token streams split along the sequence,
  // the sample gathered after proj_out. Everything else is per token or per sample.
  parallel::CpPlan plan = {
      {"hidden_states", CpAction::Split, 1, SequenceStream::Image},
      {"encoder_hidden_states", CpAction::Split, 1, SequenceStream::Text},
  };
  plan.insert(plan.end(), model_points.begin(), model_points.end());
  plan.push_back({"proj_out", CpAction::Gather, 1, SequenceStream::Image});
  return plan;
}

}  // namespace shardit::models
