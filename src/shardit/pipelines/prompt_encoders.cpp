#include "shardit/pipelines/prompt_encoders.h"

#include <fmt/core.h>

#include <algorithm>
#include <vector>

#include "shardit/dist/world.h"
#include "shardit/models/registry.h"
#include "shardit/parallel/parallel_dims.h"

namespace shardit::pipelines {
namespace {

std::unique_ptr<tokenizers::Tokenizer> open_tokenizer(const io::ModelFolder& folder, const std::string& name) {
  const std::string class_name = folder.model_index().at(name).at(1).get<std::string>();
  return models::create_tokenizer(folder.component(name).dir, class_name);
}

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

at::Tensor token_rows(const std::vector<tokenizers::Encoding>& rows, bool mask) {
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

HeldTextEncoder held_text_encoder(const TextEncoderSlot& slot, const io::ComponentFolder& folder) {
  if (slot.build_part) return slot.build_part(folder);
  return {models::create_text_encoder(folder), ""};
}

bool has_prompt_encoder_components(const io::ModelFolder& folder, const PromptEncoderRecipe& recipe) {
  const auto listed = folder.components();
  const auto has = [&](const std::string& name) { return std::find(listed.begin(), listed.end(), name) != listed.end(); };
  for (const auto& slot : recipe.slots) {
    if (!has(slot.tokenizer) || !has(slot.text_encoder)) return false;
  }
  return true;
}

std::shared_ptr<PromptEncoder> load_prompt_encoder(const io::ModelFolder& folder, const std::string& pipeline_class,
                                                   const PromptEncoderRecipe& recipe,
                                                   const TextEncoderLoadOptions& options) {
  dist::World& world = dist::World::get();
  const std::vector<TextEncoderSlot>& names = recipe.slots;
  // Everything is opened before anything loads: a missing component or file is named at once.
  std::vector<io::ComponentFolder> components;
  std::vector<std::unique_ptr<tokenizers::Tokenizer>> tokenizers;
  std::vector<std::shared_ptr<parallel::TensorParallelModule>> encoders;
  for (const auto& name : names) {
    components.push_back(folder.component(name.text_encoder));
    // The class first: a registered encoder of another family would load and then fail.
    TORCH_CHECK(components.back().class_name() == name.class_name, components.back().dir,
                "/config.json: a ", pipeline_class, " encodes prompts with a ", name.class_name, " as its ",
                name.text_encoder, ", got '", components.back().class_name(), "'; give the ", pipeline_class,
                " folder its own text encoder");
    tokenizers.push_back(open_tokenizer(folder, name.tokenizer));
    encoders.push_back(held_text_encoder(name, components.back()).module);
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
  // The one path from a degree to ranks: blocks of `degree` consecutive ranks (a world of one rank
  // has no mesh and loads the encoders whole).
  load.tensor_parallel = parallel::ParallelDims{1, 1, 1, degree}.build(world).tensor_parallel();
  for (size_t i = 0; i < encoders.size(); ++i) encoders[i]->load(components[i].weights(), load);

  return recipe.make(folder, std::move(tokenizers), std::move(encoders));
}

}  // namespace shardit::pipelines
