#pragma once
// Verification plumbing for the text encoders' golden cases (inputs.safetensors with input_ids and
// attention_mask, and for Qwen2.5-VL the left-padded `left.*` pair): runs an encoder as the
// golden outputs were made and names every output as they are named.
#include <ATen/ATen.h>

#include <map>
#include <string>

#include "shardit/io/safetensors.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::verify {

/// Runs `encoder` (built by models::create_text_encoder, loaded) on a case's inputs, the way
/// each golden case calls it, and returns the outputs under their golden names (fp32 or int64,
/// on the CPU):
///   CLIPTextModel: hidden_states.<i>, last_hidden_state, pooler_output; the same with the
///     attention mask as masked.*.
///   T5EncoderModel: the same names, plus relative_position_bucket and (whole model only)
///     position_bias.
///   Qwen3ForCausalLM: hidden_states.<i>, last_hidden_state, klein_prompt_embeds (FLUX.2 [klein]),
///     and logits when the head is tied and the model whole.
///   Qwen2_5_VLForConditionalGeneration: hidden_states.<i>, last_hidden_state, position_ids,
///     qwenimage_prompt_embeds(_mask); left.* from the left.* inputs when the case has them.
///   Mistral3ForConditionalGeneration: hidden_states.<i>, last_hidden_state, flux2_prompt_embeds
///     (FLUX.2 [dev]), flux2_text_ids, right.flux2_prompt_embeds from the right.* inputs, and
///     padrows_uniform.flux2_prompt_embeds with the other key-less-row rule.
std::map<std::string, at::Tensor> run_encoder_case(parallel::TensorParallelModule& encoder,
                                                   const io::SafetensorsFile& inputs);

}  // namespace shardit::verify
