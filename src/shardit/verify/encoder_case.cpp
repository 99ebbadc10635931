#include "shardit/verify/encoder_case.h"

#include <c10/util/Exception.h>

#include <functional>
#include <optional>
#include <utility>

#include "shardit/models/clip/modeling_clip.h"
#include "shardit/models/flux2/transformer_flux2.h"
#include "shardit/models/mistral/modeling_mistral3.h"
#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/models/t5/modeling_t5.h"
#include "shardit/nn/module.h"

namespace shardit::verify {

namespace {

using Outputs = std::map<std::string, at::Tensor>;

at::Tensor to_output(const at::Tensor& value) {
  const at::Tensor cpu = value.to(at::kCPU);
  return (at::isFloatingType(cpu.scalar_type()) ? cpu.to(at::kFloat) : cpu.to(at::kLong)).contiguous().clone();
}

/// Runs `forward` while recording what the modules emit, as `prefix` + name.
void record(Outputs& outputs, const std::string& prefix, const std::function<void()>& forward) {
  const nn::ObserveForward observe([&](const std::string&, const std::string& name, const at::Tensor& value) {
    outputs[prefix + name] = to_output(value);
  });
  forward();
}

at::Tensor read_ids(const io::SafetensorsFile& inputs, const std::string& name) {
  TORCH_CHECK(inputs.contains(name), inputs.path(), ": has no '", name, "' (a text-encoder case holds input_ids and ",
              "attention_mask)");
  const at::Tensor ids = inputs.read(name);
  TORCH_CHECK(!at::isFloatingType(ids.scalar_type()), inputs.path(), ": '", name, "' is ", ids.scalar_type(),
              ", expected integer token ids");
  return ids.to(at::kLong);
}

}  // namespace

std::map<std::string, at::Tensor> run_encoder_case(parallel::TensorParallelModule& encoder,
                                                   const io::SafetensorsFile& inputs) {
  Outputs out;
  const at::Tensor input_ids = read_ids(inputs, "input_ids");
  const at::Tensor attention_mask = read_ids(inputs, "attention_mask");
  const bool whole = encoder.tp_degree() == 1;

  if (auto* clip = dynamic_cast<models::CLIPTextModel*>(&encoder)) {
    // FLUX.1 calls CLIP without a mask; the masked run pins the mask down too.
    record(out, "", [&] { clip->forward(input_ids); });
    record(out, "masked.", [&] { clip->forward(input_ids, attention_mask); });
    return out;
  }
  if (auto* t5 = dynamic_cast<models::T5EncoderModel*>(&encoder)) {
    record(out, "", [&] { t5->forward(input_ids); });
    Outputs masked;
    record(masked, "masked.", [&] { t5->forward(input_ids, attention_mask); });
    for (auto& [name, value] : masked) {
      if (name.rfind("masked.hidden_states.", 0) == 0 || name == "masked.last_hidden_state") out[name] = value;
    }
    // Local heads only under tensor parallelism: not the golden tensor.
    if (!whole) out.erase("position_bias");
    return out;
  }
  if (auto* qwen3 = dynamic_cast<models::Qwen3ForCausalLM*>(&encoder)) {
    record(out, "", [&] { qwen3->forward(input_ids, attention_mask); });
    out["klein_prompt_embeds"] = to_output(models::flux2_klein_prompt_embeds(*qwen3, input_ids, attention_mask));
    if (whole && qwen3->config.tie_word_embeddings) {
      // The tied head: logits = last_hidden_state embed_tokens^T.
      const at::Tensor weight = qwen3->model->embed_tokens->weight;
      out["logits"] = to_output(at::matmul(out.at("last_hidden_state").to(weight.device(), weight.scalar_type()), weight.t()));
    }
    return out;
  }
  if (auto* qwen25 = dynamic_cast<models::Qwen2_5_VLForConditionalGeneration*>(&encoder)) {
    at::Tensor last;
    record(out, "", [&] { last = qwen25->forward(input_ids, attention_mask).last_hidden_state; });
    const models::QwenImagePromptEmbeds embeds =
        models::qwenimage_prompt_embeds_from_hidden(last, attention_mask);
    out["qwenimage_prompt_embeds"] = to_output(embeds.prompt_embeds);
    out["qwenimage_prompt_embeds_mask"] = to_output(embeds.prompt_embeds_mask);
    if (inputs.contains("left.input_ids")) {
      const at::Tensor left_ids = read_ids(inputs, "left.input_ids");
      const at::Tensor left_mask = read_ids(inputs, "left.attention_mask");
      record(out, "left.", [&] { qwen25->forward(left_ids, left_mask); });
    }
    return out;
  }
  if (auto* mistral = dynamic_cast<models::Mistral3ForConditionalGeneration*>(&encoder)) {
    record(out, "", [&] { mistral->forward(input_ids, attention_mask); });
    out["flux2_prompt_embeds"] = to_output(models::flux2_dev_prompt_embeds(*mistral, input_ids, attention_mask));
    out["flux2_text_ids"] = models::flux2_text_ids(input_ids.size(0), input_ids.size(1));
    if (inputs.contains("right.input_ids")) {
      out["right.flux2_prompt_embeds"] = to_output(models::flux2_dev_prompt_embeds(
          *mistral, read_ids(inputs, "right.input_ids"), read_ids(inputs, "right.attention_mask")));
    }
    // The other rule for key-less (left-padding) query rows, then back to the model's own.
    models::KeylessQueryRows& rule = mistral->keyless_query_rows();
    const models::KeylessQueryRows own = rule;
    rule = models::KeylessQueryRows::Uniform;
    try {
      out["padrows_uniform.flux2_prompt_embeds"] =
          to_output(models::flux2_dev_prompt_embeds(*mistral, input_ids, attention_mask));
    } catch (...) {
      rule = own;
      throw;
    }
    rule = own;
    return out;
  }
  TORCH_CHECK(false, encoder.type_name(), " is not a text encoder (supported: CLIPTextModel, T5EncoderModel, ",
              "Qwen3ForCausalLM, Qwen2_5_VLForConditionalGeneration, Mistral3ForConditionalGeneration)");
}

}  // namespace shardit::verify
