// Every text encoder against transformers' golden tensors, through the real load path: each
// per-layer hidden state, the final state, CLIP's pooled output, T5's position buckets and bias,
// and the pipelines' prompt embeddings (FLUX.2 [klein]'s stacked layers, Qwen-Image's dropped
// template and mask). fp32 tolerance 1e-4 + 1e-4|b| (golden README: the reference's own fp32 vs
// fp64 spread is <= 3e-5 here, on values up to 33).
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/clip/modeling_clip.h"
#include "shardit/models/mistral/modeling_mistral3.h"
#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/models/registry.h"
#include "shardit/verify/encoder_case.h"
#include "support/test_support.h"

namespace shardit {
namespace test_parity_encoders {
namespace {

using testing::golden_path;
using testing::tensors_close;

constexpr double kTol = 1e-4;

class EncoderParity : public ::testing::TestWithParam<std::string> {};

/// Rows [b, s] of `t` ([B, S, ...]) where `mask` [B, S] is nonzero, stacked.
at::Tensor valid_rows(const at::Tensor& t, const at::Tensor& mask) {
  // [B * S, ...] -> [n_valid, ...]
  return t.flatten(0, 1).index_select(0, mask.flatten().ne(0).nonzero().flatten());
}

TEST_P(EncoderParity, EveryOutputMatchesTransformers) {
  const std::string dir = golden_path("text/" + GetParam());
  const io::ComponentFolder folder = io::open_component(dir, "text_encoder");
  auto model = models::create_text_encoder(folder);
  model->load(folder.weights(), {});
  const auto inputs = io::SafetensorsFile::open(dir + "/inputs.safetensors");
  const std::map<std::string, at::Tensor> produced = verify::run_encoder_case(*model, *inputs);

  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  size_t compared = 0;
  for (const std::string& name : outputs->names()) {
    const auto it = produced.find(name);
    if (it == produced.end()) {
      ADD_FAILURE() << GetParam() << ": golden output '" << name << "' was not produced";
      continue;
    }
    at::Tensor actual = it->second.to(at::kDouble);
    at::Tensor expected = outputs->read(name).to(at::kDouble);
    const bool left = name.rfind("left.hidden_states.", 0) == 0;
    if (left || name.rfind("right.", 0) == 0) {
      // Qwen2.5-VL's left.*: query rows with no key left (left padding) follow the eager rule
      // there, compare tokens only. Mistral-3's right.*: the same prompts right-padded, whose
      // padding rows the golden README leaves out of the comparison.
      const at::Tensor mask = inputs->read(left ? "left.attention_mask" : "right.attention_mask");
      ASSERT_EQ(actual.sizes(), expected.sizes()) << name;
      actual = valid_rows(actual, mask);
      expected = valid_rows(expected, mask);
    }
    const auto result = tensors_close(GetParam() + " " + name, actual, expected, kTol, kTol);
    EXPECT_TRUE(result);
    std::cout << "  compared " << result.message() << "\n";
    ++compared;
  }
  std::cout << GetParam() << ": compared " << compared << " of " << outputs->names().size() << " golden tensors\n";
  EXPECT_EQ(compared, outputs->names().size());
}

TEST_P(EncoderParity, ParametersAreTheCheckpointKeys) {
  const io::ComponentFolder folder = io::open_component(golden_path("text/" + GetParam()), "text_encoder");
  auto model = models::create_text_encoder(folder);
  const io::Checkpoint checkpoint = folder.weights();
  const parallel::ModelTraits traits = model->traits();
  std::map<std::string, std::vector<std::string>> aliases(traits.key_aliases.begin(), traits.key_aliases.end());
  for (const auto& slot : model->named_states()) {
    std::vector<std::string> keys{slot.name};
    const auto alias = aliases.find(slot.name);
    if (alias != aliases.end()) keys.insert(keys.end(), alias->second.begin(), alias->second.end());
    const auto stored = std::find_if(keys.begin(), keys.end(), [&](const std::string& k) { return checkpoint.contains(k); });
    if (stored == keys.end()) {
      ADD_FAILURE() << "model state '" << slot.name << "' is not in the checkpoint";
      continue;
    }
    EXPECT_EQ(slot.tensor->sizes().vec(), checkpoint.info(*stored).shape) << "shape of '" << slot.name << "'";
  }
  // Loading refuses unexpected keys unless the traits ignore them: a load is the check.
  model->load(checkpoint, {});
}

INSTANTIATE_TEST_SUITE_P(Golden, EncoderParity,
                         ::testing::Values("clip_text", "clip_text_eos", "t5_encoder", "qwen3_klein", "qwen2_5_vl_text",
                                           "mistral3_flux2"));

/// Runs `embeds(model, input_ids, attention_mask)` on a golden case and checks that it ran layer
/// `last` (hidden_states.<last> emitted) and nothing after it, and matches the golden `name`.
template <class Model, class Embeds>
at::Tensor expect_embeds_run_only_needed_layers(const std::string& golden_case, int64_t last, const std::string& name,
                                                const Embeds& embeds) {
  const std::string dir = golden_path("text/" + golden_case);
  const io::ComponentFolder folder = io::open_component(dir, "text_encoder");
  auto model = std::dynamic_pointer_cast<Model>(models::create_text_encoder(folder));
  EXPECT_NE(model, nullptr) << golden_case;
  if (model == nullptr) return {};
  model->load(folder.weights(), {});
  const auto inputs = io::SafetensorsFile::open(dir + "/inputs.safetensors");
  std::set<std::string> emitted;
  at::Tensor out;
  {
    const nn::ObserveForward observe([&](const std::string&, const std::string& n, const at::Tensor&) { emitted.insert(n); });
    out = embeds(*model, inputs->read("input_ids"), inputs->read("attention_mask"));
  }
  EXPECT_EQ(emitted.count("hidden_states." + std::to_string(last)), 1u) << golden_case;
  EXPECT_EQ(emitted.count("hidden_states." + std::to_string(last + 1)), 0u) << golden_case;
  EXPECT_EQ(emitted.count("last_hidden_state"), 0u) << golden_case;
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  EXPECT_TRUE(tensors_close(name, out, outputs->read(name), kTol, kTol));
  return out;
}

TEST(EncoderPipelines, GoldenKleinEmbedsRunOnlyTheLayersTheyNeed) {
  // The stacked layers end at 27 of 28: the last layer and the norm are not run, and the result
  // is the same as from the full forward.
  expect_embeds_run_only_needed_layers<models::Qwen3ForCausalLM>(
      "qwen3_klein", 27, "klein_prompt_embeds", [](auto& model, const at::Tensor& ids, const at::Tensor& mask) {
        return models::flux2_klein_prompt_embeds(model, ids, mask);
      });
}

TEST(EncoderPipelines, GoldenFlux2DevEmbedsRunOnlyTheLayersTheyNeed) {
  // FLUX.2 [dev] stacks layers 10/20/30 of 32: layers 31 and 32 and the norm are not run.
  const at::Tensor embeds = expect_embeds_run_only_needed_layers<models::Mistral3ForConditionalGeneration>(
      "mistral3_flux2", 30, "flux2_prompt_embeds", [](auto& model, const at::Tensor& ids, const at::Tensor& mask) {
        return models::flux2_dev_prompt_embeds(model, ids, mask);
      });
  // One row is left-padded: its padding rows are what separates the two rules, so they must
  // differ between the goldens (the comparison above covers every row, padding included).
  const std::string dir = golden_path("text/mistral3_flux2");
  const at::Tensor first_mask = io::SafetensorsFile::open(dir + "/inputs.safetensors")->read("attention_mask").select(1, 0);
  ASSERT_EQ(first_mask.eq(0).sum().item<int64_t>(), 1) << "one row of the golden inputs starts with padding";
  const int64_t row = first_mask.eq(0).nonzero().item<int64_t>();
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  const at::Tensor uniform = outputs->read("padrows_uniform.flux2_prompt_embeds");
  EXPECT_GT((uniform[row][0] - outputs->read("flux2_prompt_embeds")[row][0]).abs().max().item<double>(), 1e-2);
  ASSERT_TRUE(embeds.defined());
  EXPECT_GT((uniform[row][0] - embeds[row][0]).abs().max().item<double>(), 1e-2);
}

TEST(EncoderPipelines, GoldenFlux2DevTextEncoderHoldsOnlyTheLayersItReads) {
  // Flux2Pipeline's encoder: 30 of the golden's 32 layers built and loaded (the checkpoint's
  // layers 30 and 31 read past), the same embeddings, fewer bytes, and a named refusal of the
  // hidden states it cannot give.
  const std::string dir = golden_path("text/mistral3_flux2");
  const io::ComponentFolder folder = io::open_component(dir, "text_encoder");
  auto whole = models::create_text_encoder(folder);
  auto model = models::flux2_dev_text_encoder(models::Mistral3Config::from_json(folder.config, dir + "/config.json"));
  EXPECT_EQ(model->language_model->model->layers->size(), 30u);
  model->load(folder.weights(), {});
  whole->load(folder.weights(), {});
  EXPECT_LT(model->parameter_bytes(), whole->parameter_bytes());
  const auto inputs = io::SafetensorsFile::open(dir + "/inputs.safetensors");
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  EXPECT_TRUE(tensors_close("flux2_prompt_embeds (30 layers built)",
                            models::flux2_dev_prompt_embeds(*model, inputs->read("input_ids"), inputs->read("attention_mask")),
                            outputs->read("flux2_prompt_embeds"), kTol, kTol));
  const std::string message = testing::error_of([&] { model->forward(inputs->read("input_ids"), std::nullopt); });
  EXPECT_NE(message.find("built with its first 30 of 32"), std::string::npos) << message;
}

}  // namespace
}  // namespace test_parity_encoders
}  // namespace shardit
