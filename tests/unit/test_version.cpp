// `shardit version` and --version (nn/build_info.h): the LibTorch a build runs with is the one it
// was built with, CUDA and NCCL are stated as compiled in or "none", the collectives follow, the
// kernels named are registered ones, and the CLI prints the same facts as text and as JSON.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/version.h>

#include <map>
#include <regex>
#include <string>

#include "shardit/nn/attention/backends.h"
#include "shardit/nn/build_info.h"
#include "support/test_support.h"

namespace test_version {
namespace {

std::map<std::string, std::string> facts() {
  std::map<std::string, std::string> out;
  for (const auto& [name, value] : shardit::nn::build_facts()) {
    EXPECT_TRUE(out.emplace(name, value).second) << "fact " << name << " twice";
    EXPECT_FALSE(value.empty()) << "fact " << name << " is empty";
  }
  return out;
}

bool registered(const std::string& name) {
  for (const std::string& backend : shardit::nn::attention_backend_names()) {
    if (backend == name) return true;
  }
  return false;
}

TEST(BuildFacts, NameTheLibTorchBuiltWithAndRunning) {
  const auto f = facts();
  EXPECT_EQ(f.at("libtorch_built"), TORCH_VERSION);
  // This test executable runs with the LibTorch it was linked with; the running version is read
  // from the loaded library, not from the headers.
  EXPECT_EQ(f.at("libtorch_running"), TORCH_VERSION);
  EXPECT_EQ(shardit::nn::running_libtorch_version(), TORCH_VERSION);
  EXPECT_TRUE(std::regex_match(f.at("shardit"), std::regex("[0-9]+\\.[0-9]+\\.[0-9]+"))) << f.at("shardit");
}

TEST(BuildFacts, StateCudaNcclAndTheCollectivesCompiledIn) {
  const auto f = facts();
  if (SHARDIT_WITH_CUDA) {
    EXPECT_TRUE(std::regex_search(f.at("cuda"), std::regex("^[0-9]+\\.[0-9]+"))) << f.at("cuda");
  } else {
    EXPECT_EQ(f.at("cuda"), "none");
  }
  if (SHARDIT_WITH_NCCL) {
    EXPECT_TRUE(std::regex_match(f.at("nccl"), std::regex("[0-9]+\\.[0-9]+\\.[0-9]+"))) << f.at("nccl");
    EXPECT_EQ(f.at("collectives"), "gloo (CPU tensors), nccl (CUDA tensors)");
  } else {
    EXPECT_EQ(f.at("nccl"), "none");
    EXPECT_EQ(f.at("collectives"), "gloo (CPU tensors)");
  }
  EXPECT_TRUE(f.at("cuda_device") == "yes" || f.at("cuda_device") == "none") << f.at("cuda_device");
}

TEST(BuildFacts, NameRegisteredKernels) {
  const auto f = facts();
  EXPECT_TRUE(registered(f.at("fp32_attention_on"))) << f.at("fp32_attention_on");
  EXPECT_TRUE(registered(f.at("bf16_attention_on"))) << f.at("bf16_attention_on");
  EXPECT_EQ(f.at("attention_backends").find("sdpa") != std::string::npos, registered("sdpa"));
  for (const char* name : {"cpu_features", "cpu_isa", "fp32_products_on", "fused_cpu_kernels"}) {
    EXPECT_NE(f.at(name), "unknown") << name;
  }
}

TEST(VersionCli, PrintsTheFactsAsTextAndAsJson) {
  const std::string cli = shardit::testing::cli_path();
  std::string text;
  ASSERT_EQ(shardit::testing::run_command(cli + " version", &text), 0) << text;
  std::string flag;
  ASSERT_EQ(shardit::testing::run_command(cli + " --version", &flag), 0) << flag;
  EXPECT_EQ(flag, text);
  std::string json_text;
  ASSERT_EQ(shardit::testing::run_command(cli + " version --json", &json_text), 0) << json_text;
  const nlohmann::json json = nlohmann::json::parse(json_text);
  const auto expected = facts();
  ASSERT_EQ(json.size(), expected.size()) << json_text;
  for (const auto& [name, value] : expected) {
    ASSERT_TRUE(json.contains(name)) << name << " missing from " << json_text;
    const std::string printed = json.at(name).get<std::string>();
    // The build's facts are the same in every process of the build (the kernels too, but a test
    // process may have registered attention backends of its own).
    if (name != "attention_backends") {
      EXPECT_EQ(printed, value) << name;
    }
    // Each fact is one "name:  value" line of the text.
    const size_t at = ("\n" + text).find("\n" + name + ":");
    ASSERT_NE(at, std::string::npos) << name << " missing from\n" << text;
    const size_t end = text.find('\n', at);
    const std::string line = text.substr(at, end - at);
    const size_t start = line.find_first_not_of(' ', name.size() + 1);
    EXPECT_EQ(line.substr(start), printed) << line;
  }
}

}  // namespace
}  // namespace test_version
