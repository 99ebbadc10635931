// Every transformer against diffusers' golden tensors, through the real load path: the final
// sample and every intermediate the reference recorded (embeddings, modulation, RoPE tables, each
// block's streams, block-0 internals, the final norm), and the parameter names and shapes against
// the checkpoint keys. fp32 tolerance 1e-4 + 1e-4|b| (golden README: the reference's own
// fp32-vs-fp64 spread is <= 2.3e-6 with the fp32 timestep recipe we follow).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/models/registry.h"
#include "support/test_support.h"
#include "support/transformer_case_checks.h"

namespace shardit {
namespace test_parity_transformers {
namespace {

using testing::golden_path;

class TransformerParity : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformerParity, SampleAndEveryIntermediateMatchDiffusers) {
  testing::expect_sample_and_intermediates_match(GetParam(), parallel::LoadOptions{});
}

TEST_P(TransformerParity, ParametersAreExactlyTheCheckpointKeys) {
  const io::ComponentFolder folder = io::open_component(golden_path(GetParam()), "transformer");
  auto model = models::create_transformer(folder);
  const io::Checkpoint checkpoint = folder.weights();

  std::map<std::string, std::vector<int64_t>> declared;
  for (const auto& slot : model->named_parameters()) {
    EXPECT_EQ(declared.count(slot.name), 0u) << "parameter '" << slot.name << "' declared twice";
    declared[slot.name] = slot.tensor->sizes().vec();
  }
  std::map<std::string, std::vector<int64_t>> stored;
  for (const std::string& name : checkpoint.names()) stored[name] = checkpoint.info(name).shape;

  for (const auto& [name, shape] : declared) {
    auto it = stored.find(name);
    if (it == stored.end()) {
      ADD_FAILURE() << "model parameter '" << name << "' is not in the checkpoint";
    } else {
      EXPECT_EQ(shape, it->second) << "shape of '" << name << "'";
    }
  }
  for (const auto& [name, shape] : stored) {
    EXPECT_EQ(declared.count(name), 1u) << "checkpoint tensor '" << name << "' has no model parameter";
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, TransformerParity, ::testing::ValuesIn(testing::golden_transformer_cases()));

}  // namespace
}  // namespace test_parity_transformers
}  // namespace shardit
