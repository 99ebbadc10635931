#include "shardit/pipelines/prompt_encoders.h"

#include <fmt/core.h>

#include <algorithm>
#include <vector>

#include "shardit/dist/world.h"
#include "shardit/models/clip/modeling_clip.h"
#include "shardit/models/mistral/modeling_mistral3.h"
#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/models/registry.h"
#include "shardit/models/t5/modeling_t5.h"
#include "shardit/tokenizers/prompt_templates.h"

namespace shardit::pipelines {
namespace {

/// FluxPipeline.tokenizer_max_length (CLIPTokenizer.model_max_length).
constexpr int64_t kClipMaxLength = 77;

/// A pipeline's tokenizer and text-encoder components and the text-encoder class it needs.
struct EncoderComponents {
  std::string tokenizer;
  std::string text_encoder;
  std::string text_encoder_class;
};

/// The components each pipeline class encodes with.
/// The pipeline whose prompt encoding `pipeline_class` shares (FluxKontextPipeline: FluxPipeline's).
std::string prompt_family(const std::string& pipeline_class) {
  return pipeline_class == "FluxKontextPipeline" ? std::string("FluxPipeline") : pipeline_class;
}

std::vector<EncoderComponents> encoder_components(const std::string& pipeline_class) {
  if (prompt_family(pipeline_class) == "FluxPipeline") {
    return {{"tokenizer", "text_encoder", "CLIPTextModel"}, {"tokenizer_2", "text_encoder_2", "T5EncoderModel"}};
  }
  if (pipeline_class == "Flux2KleinPipeline") return {{"tokenizer", "text_encoder", "Qwen3ForCausalLM"}};
  if (pipeline_class == "Flux2Pipeline") return {{"tokenizer", "text_encoder", "Mistral3ForConditionalGeneration"}};
  if (pipeline_class == "QwenImagePipeline") {
    return {{"tokenizer", "text_encoder", "Qwen2_5_VLForConditionalGeneration"}};
  }
  TORCH_CHECK(false, "no prompt encoder for pipeline class '", pipeline_class,
              "' (supported: FluxPipeline, FluxKontextPipeline, Flux2KleinPipeline, Flux2Pipeline, QwenImagePipeline)");
}

/// One field of a batch of encodings as int64 [B, S] (rows padded to one length by the tokenizer).
at::Tensor stack_rows(const std::vector<tokenizers::Encoding>& rows, bool mask) {
  TORCH_CHECK(!rows.empty(), "no prompts to encode");
  const auto& first = mask ? rows[0].attention_mask : rows[0].input_ids;
  at::Tensor out = at::empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(first.size())}, at::kLong);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& values = mask ? rows[i].attention_mask : rows[i].input_ids;
    TORCH_INTERNAL_ASSERT(values.size() == first.size(), "tokenizer rows of different lengths");
    std::copy(values.begin(), values.end(), out[static_cast<int64_t>(i)].data_ptr<int64_t>());
  }
  return out;
}

std::unique_ptr<tokenizers::Tokenizer> open_tokenizer(const io::ModelFolder& folder, const std::string& name) {
  const std::string class_name = folder.model_index().at(name).at(1).get<std::string>();
  return models::create_tokenizer(folder.component(name).dir, class_name);
}

/// The loaded encoder as the class load_prompt_encoder checked it to be.
template <typename Model>
std::shared_ptr<Model> as_encoder(const std::shared_ptr<parallel::TensorParallelModule>& module) {
  auto model = std::dynamic_pointer_cast<Model>(module);
  TORCH_INTERNAL_ASSERT(model != nullptr, "text encoder ", module->type_name(), " is not the class checked before");
  return model;
}

/// FluxPipeline.encode_prompt: CLIP's pooled output and T5's last hidden state.
class FluxPromptEncoder : public PromptEncoder {
 public:
  FluxPromptEncoder(std::unique_ptr<tokenizers::Tokenizer> clip_tokenizer, std::shared_ptr<models::CLIPTextModel> clip,
                    std::unique_ptr<tokenizers::Tokenizer> t5_tokenizer, std::shared_ptr<models::T5EncoderModel> t5)
      : clip_tokenizer_(std::move(clip_tokenizer)),
        clip_(std::move(clip)),
        t5_tokenizer_(std::move(t5_tokenizer)),
        t5_(std::move(t5)) {}

  PromptEmbeds encode(const std::vector<std::string>& prompts, int64_t max_sequence_length) override {
    const at::Tensor clip_ids =
        stack_rows((*clip_tokenizer_)(prompts, kClipMaxLength, tokenizers::Padding::MaxLength), false);
    const at::Tensor t5_ids =
        stack_rows((*t5_tokenizer_)(prompts, max_sequence_length, tokenizers::Padding::MaxLength), false);
    PromptEmbeds out;
    out.pooled_prompt_embeds = models::flux_clip_prompt_embeds(*clip_, clip_ids.to(clip_->device()));
    out.prompt_embeds = models::flux_t5_prompt_embeds(*t5_, t5_ids.to(t5_->device()));
    return out;
  }

 private:
  std::unique_ptr<tokenizers::Tokenizer> clip_tokenizer_;
  std::shared_ptr<models::CLIPTextModel> clip_;
  std::unique_ptr<tokenizers::Tokenizer> t5_tokenizer_;
  std::shared_ptr<models::T5EncoderModel> t5_;
};

/// The FLUX.2 pipelines' encode_prompt: the tokenizer call of the pipeline's template, then a
/// stack of the decoder's hidden states. Flux2KleinPipeline: Qwen3, its chat template, hidden
/// states 9/18/27. Flux2Pipeline: Mistral-3, the system message and chat template (left-padded to
/// max_sequence_length), hidden states 10/20/30.
template <class Model>
class Flux2PromptEncoder : public PromptEncoder {
 public:
  using Tokenize = std::vector<tokenizers::Encoding> (*)(const tokenizers::Tokenizer&, const std::vector<std::string>&,
                                                          int64_t);
  using Embed = at::Tensor (*)(Model&, const at::Tensor&, const at::Tensor&, const std::vector<int64_t>&);

  Flux2PromptEncoder(std::unique_ptr<tokenizers::Tokenizer> tokenizer, std::shared_ptr<Model> encoder,
                     Tokenize tokenize, Embed embed, std::vector<int64_t> layers)
      : tokenizer_(std::move(tokenizer)),
        encoder_(std::move(encoder)),
        tokenize_(tokenize),
        embed_(embed),
        layers_(std::move(layers)) {}

  PromptEmbeds encode(const std::vector<std::string>& prompts, int64_t max_sequence_length) override {
    const auto rows = tokenize_(*tokenizer_, prompts, max_sequence_length);
    PromptEmbeds out;
    out.prompt_embeds = embed_(*encoder_, stack_rows(rows, false).to(encoder_->device()),
                               stack_rows(rows, true).to(encoder_->device()), layers_);
    return out;
  }

 private:
  std::unique_ptr<tokenizers::Tokenizer> tokenizer_;
  std::shared_ptr<Model> encoder_;
  Tokenize tokenize_;
  Embed embed_;
  std::vector<int64_t> layers_;
};

/// QwenImagePipeline.encode_prompt: Qwen2.5-VL on the templated prompt, the template prefix
/// dropped, cut to max_sequence_length, with the mask.
class QwenImagePromptEncoder : public PromptEncoder {
 public:
  QwenImagePromptEncoder(std::unique_ptr<tokenizers::Tokenizer> tokenizer,
                         std::shared_ptr<models::Qwen2_5_VLForConditionalGeneration> encoder)
      : tokenizer_(std::move(tokenizer)), encoder_(std::move(encoder)) {}

  PromptEmbeds encode(const std::vector<std::string>& prompts, int64_t max_sequence_length) override {
    const auto rows = tokenizers::encode_qwenimage_prompts(*tokenizer_, prompts);
    const models::QwenImagePromptEmbeds embeds = models::qwenimage_prompt_embeds(
        *encoder_, stack_rows(rows, false).to(encoder_->device()), stack_rows(rows, true).to(encoder_->device()));
    const int64_t length = std::min(max_sequence_length, embeds.prompt_embeds.size(1));
    PromptEmbeds out;
    out.prompt_embeds = embeds.prompt_embeds.slice(1, 0, length);
    out.prompt_embeds_mask = embeds.prompt_embeds_mask.slice(1, 0, length);
    return out;
  }

 private:
  std::unique_ptr<tokenizers::Tokenizer> tokenizer_;
  std::shared_ptr<models::Qwen2_5_VLForConditionalGeneration> encoder_;
};

/// Whether every encoder's plan resolves at `degree`.
bool degree_fits(const std::vector<std::shared_ptr<parallel::TensorParallelModule>>& encoders, int degree,
                 at::ScalarType dtype) {
  for (const auto& encoder : encoders) {
    try {
      encoder->resolve(degree, dtype);
    } catch (const c10::Error&) {
      return false;
    }
  }
  return true;
}

}  // namespace

bool has_prompt_encoder_components(const io::ModelFolder& folder, const std::string& pipeline_class) {
  const auto listed = folder.components();
  const auto has = [&](const std::string& name) { return std::find(listed.begin(), listed.end(), name) != listed.end(); };
  for (const auto& names : encoder_components(pipeline_class)) {
    if (!has(names.tokenizer) || !has(names.text_encoder)) return false;
  }
  return true;
}

std::shared_ptr<PromptEncoder> load_prompt_encoder(const io::ModelFolder& folder, const std::string& pipeline_class,
                                                   const TextEncoderLoadOptions& options) {
  dist::World& world = dist::World::get();
  const auto names = encoder_components(pipeline_class);
  // Everything is opened before anything loads: a missing component or file is named at once.
  std::vector<io::ComponentFolder> components;
  std::vector<std::unique_ptr<tokenizers::Tokenizer>> tokenizers;
  std::vector<std::shared_ptr<parallel::TensorParallelModule>> encoders;
  for (const auto& name : names) {
    components.push_back(folder.component(name.text_encoder));
    // The class first: a registered encoder of another family would load and then fail.
    TORCH_CHECK(components.back().class_name() == name.text_encoder_class, components.back().dir,
                "/config.json: a ", pipeline_class, " encodes prompts with a ", name.text_encoder_class, " as its ",
                name.text_encoder, ", got '", components.back().class_name(), "'; give the ", pipeline_class,
                " folder its own text encoder");
    tokenizers.push_back(open_tokenizer(folder, name.tokenizer));
    if (pipeline_class == "Flux2Pipeline") {
      // Only the layers up to the last stacked hidden state are built and loaded.
      encoders.push_back(models::flux2_dev_text_encoder(
          models::Mistral3Config::from_json(components.back().config, components.back().dir + "/config.json")));
    } else {
      encoders.push_back(models::create_text_encoder(components.back()));
    }
  }

  int degree = 1;
  const int ranks = options.replica_size > 0 ? options.replica_size : world.size();
  const std::string ranks_what = options.replica_size > 0 && options.replica_size < world.size()
                                     ? "the ranks of a replica (" + std::to_string(ranks) + ")"
                                     : "the number of ranks (" + std::to_string(ranks) + ")";
  if (options.tp_degree) {
    degree = *options.tp_degree;
    TORCH_CHECK(degree >= 1 && ranks % degree == 0, "--text-encoder-tp ", degree, " must divide ", ranks_what);
    // Every encoder's plan at that degree, before any of them loads: the error names the encoder.
    for (size_t i = 0; i < encoders.size(); ++i) {
      try {
        encoders[i]->resolve(degree, options.dtype);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, pipeline_class, "'s ", names[i].text_encoder, " (", encoders[i]->type_name(),
                    ") cannot run at --text-encoder-tp ", degree, ": ", e.what_without_backtrace());
      }
    }
  } else {
    for (int d = ranks; d >= 1; --d) {
      if (ranks % d == 0 && degree_fits(encoders, d, options.dtype)) {
        degree = d;
        break;
      }
    }
    if (degree != options.transformer_tp_degree && world.rank() == 0) {
      fmt::print(stderr, "note: the text encoders run at tensor-parallel degree {} (transformer: {}): {}\n", degree,
                 options.transformer_tp_degree,
                 "the largest degree dividing the ranks that their heads allow; set it with --text-encoder-tp");
    }
  }

  parallel::LoadOptions load;
  load.dtype = options.dtype;
  load.device = options.device;
  if (world.size() > 1 || degree != 1) load.tensor_parallel = parallel::TensorParallelConfig::from_degree(world, degree);
  for (size_t i = 0; i < encoders.size(); ++i) encoders[i]->load(components[i].weights(), load);

  if (prompt_family(pipeline_class) == "FluxPipeline") {
    return std::make_shared<FluxPromptEncoder>(std::move(tokenizers[0]), as_encoder<models::CLIPTextModel>(encoders[0]),
                                               std::move(tokenizers[1]), as_encoder<models::T5EncoderModel>(encoders[1]));
  }
  if (pipeline_class == "Flux2KleinPipeline") {
    return std::make_shared<Flux2PromptEncoder<models::Qwen3ForCausalLM>>(
        std::move(tokenizers[0]), as_encoder<models::Qwen3ForCausalLM>(encoders[0]),
        &tokenizers::encode_flux2_klein_prompts, &models::flux2_klein_prompt_embeds,
        models::flux2_klein_hidden_states_layers());
  }
  if (pipeline_class == "Flux2Pipeline") {
    return std::make_shared<Flux2PromptEncoder<models::Mistral3ForConditionalGeneration>>(
        std::move(tokenizers[0]), as_encoder<models::Mistral3ForConditionalGeneration>(encoders[0]),
        &tokenizers::encode_flux2_dev_prompts, &models::flux2_dev_prompt_embeds, models::flux2_dev_hidden_states_layers());
  }
  return std::make_shared<QwenImagePromptEncoder>(std::move(tokenizers[0]),
                                                  as_encoder<models::Qwen2_5_VLForConditionalGeneration>(encoders[0]));
}

}  // namespace shardit::pipelines
