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
#include "shardit/models/qwen/modeling_qwen3.h"
#include "shardit/models/registry.h"
#include "shardit/verify/encoder_case.h"
#include "support/test_support.h"

namespace shardit {
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
    if (name.rfind("left.hidden_states.", 0) == 0) {
      // Query rows with no key left (left padding) are implementation-defined: compare tokens only.
      const at::Tensor mask = inputs->read("left.attention_mask");
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
                         ::testing::Values("clip_text", "clip_text_eos", "t5_encoder", "qwen3_klein", "qwen2_5_vl_text"));

TEST(EncoderPipelines, GoldenKleinEmbedsRunOnlyTheLayersTheyNeed) {
  // The stacked layers end at 27 of 28: the last layer and the norm are not run, and the result
  // is the same as from the full forward.
  const std::string dir = golden_path("text/qwen3_klein");
  const io::ComponentFolder folder = io::open_component(dir, "text_encoder");
  auto model = std::dynamic_pointer_cast<models::Qwen3ForCausalLM>(models::create_text_encoder(folder));
  ASSERT_NE(model, nullptr);
  model->load(folder.weights(), {});
  const auto inputs = io::SafetensorsFile::open(dir + "/inputs.safetensors");
  std::set<std::string> emitted;
  at::Tensor embeds;
  {
    const nn::ObserveForward observe([&](const std::string&, const std::string& name, const at::Tensor&) { emitted.insert(name); });
    embeds = models::flux2_klein_prompt_embeds(*model, inputs->read("input_ids"), inputs->read("attention_mask"));
  }
  EXPECT_EQ(emitted.count("hidden_states.27"), 1u);
  EXPECT_EQ(emitted.count("hidden_states.28"), 0u);
  EXPECT_EQ(emitted.count("last_hidden_state"), 0u);
  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  EXPECT_TRUE(tensors_close("klein_prompt_embeds", embeds, outputs->read("klein_prompt_embeds"), kTol, kTol));
}

}  // namespace
}  // namespace shardit
