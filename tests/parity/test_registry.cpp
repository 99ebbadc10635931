// The component registry: every kind a diffusers pipeline folder names in model_index.json is
// built from the golden pipeline folders by its [library, class] entry, and an unknown class is
// refused listing the supported ones of its kind.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/io/model_folder.h"
#include "shardit/models/registry.h"
#include "support/test_support.h"

namespace test_registry {
namespace {

using shardit::models::ComponentKind;
using shardit::testing::error_of;
using shardit::testing::golden_path;

ComponentKind kind_of(const std::string& component) {
  if (component.rfind("text_encoder", 0) == 0) return ComponentKind::TextEncoder;
  if (component.rfind("tokenizer", 0) == 0) return ComponentKind::Tokenizer;
  if (component == "scheduler") return ComponentKind::Scheduler;
  if (component == "vae") return ComponentKind::Vae;
  return ComponentKind::Transformer;
}

class PipelineComponents : public ::testing::TestWithParam<std::string> {};

// Every tokenizer, scheduler, transformer and VAE of the golden pipelines is a registered class and
// builds from its folder; text encoders are checked to be named by model_index.json.
TEST_P(PipelineComponents, EveryComponentIsBuiltByTheRegistry) {
  const std::string root = golden_path(GetParam());
  const nlohmann::json index = shardit::io::read_json_file(root + "/model_index.json");
  int built = 0;
  for (const auto& [name, entry] : index.items()) {
    if (!entry.is_array() || entry.size() != 2 || !entry[1].is_string()) continue;
    const std::string class_name = entry[1].get<std::string>();
    const std::string folder = root + "/" + name;
    switch (kind_of(name)) {
      case ComponentKind::Tokenizer:
        EXPECT_NE(shardit::models::create_tokenizer(folder, class_name), nullptr) << name;
        ++built;
        break;
      case ComponentKind::Scheduler:
        EXPECT_GT(shardit::models::create_scheduler(folder, class_name).config().num_train_timesteps, 0) << name;
        ++built;
        break;
      case ComponentKind::Transformer:
        EXPECT_NE(shardit::models::create_transformer(shardit::io::open_component(root, name)), nullptr) << name;
        ++built;
        break;
      case ComponentKind::Vae:
        EXPECT_NE(shardit::models::create_vae(shardit::io::open_component(root, name)), nullptr) << name;
        ++built;
        break;
      case ComponentKind::TextEncoder:
        break;
    }
  }
  EXPECT_GE(built, 4) << GetParam() << ": tokenizer(s), scheduler, transformer and VAE";
}

INSTANTIATE_TEST_SUITE_P(Golden, PipelineComponents,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_flux2_dev",
                                           "pipeline_qwenimage"));

TEST(ComponentRegistry, UnknownClassesAreRefusedListingTheSupportedOnes) {
  const std::string folder = golden_path("pipeline_flux1/tokenizer");
  EXPECT_EQ(error_of([&] { shardit::models::create_tokenizer(folder, "GPT2Tokenizer"); }),
            folder + ": unsupported tokenizer class 'GPT2Tokenizer'; supported: CLIPTokenizer, CLIPTokenizerFast, "
                     "T5Tokenizer, T5TokenizerFast, Qwen2Tokenizer, Qwen2TokenizerFast, LlamaTokenizerFast, "
                     "PixtralProcessor");
  const std::string scheduler = golden_path("pipeline_flux1/scheduler");
  EXPECT_EQ(error_of([&] { shardit::models::create_scheduler(scheduler, "DDIMScheduler"); }),
            scheduler + ": unsupported scheduler class 'DDIMScheduler'; supported: FlowMatchEulerDiscreteScheduler");
}

}  // namespace
}  // namespace test_registry
