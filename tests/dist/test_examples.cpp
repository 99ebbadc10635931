// The example programs (examples/*.cpp), run as a user would: two ranks from a launcher, the
// transformer sharded on load and through enable_parallelism, on the golden tiny pipelines; rank
// 0's PNGs must equal diffusers' within one level.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "shardit/dist/launcher.h"
#include "shardit/io/png.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_examples {
namespace {

struct ExampleCase {
  std::string program;
  std::string golden;
};

void PrintTo(const ExampleCase& example, std::ostream* os) { *os << example.program; }

class Examples : public ::testing::TestWithParam<ExampleCase> {};

TEST_P(Examples, GoldenTp2WritesDiffusersImage) {
  const auto golden = shardit::testing::read_pipeline_case(shardit::testing::golden_path(GetParam().golden));
  const std::string dir = shardit::testing::make_temp_dir("example");
  for (const bool in_memory : {false, true}) {
    std::vector<std::string> argv = {std::string(SHARDIT_EXAMPLES_DIR) + "/" + GetParam().program};
    // The case's call: model, embeddings, latents, size and steps, and its guidance option.
    for (size_t i = 0; i < golden.cli_args.size(); i += 2) {
      const std::string& flag = golden.cli_args[i];
      if (flag == "--num-images" || flag == "--max-sequence-length") continue;
      argv.push_back(flag);
      argv.push_back(golden.cli_args[i + 1]);
    }
    const std::string out = dir + (in_memory ? "/in_memory.png" : "/on_load.png");
    argv.insert(argv.end(), {"--out", out});
    if (in_memory) argv.push_back("--enable-parallelism");
    shardit::dist::LocalLaunchOptions options;
    options.nproc = 2;
    ASSERT_EQ(shardit::dist::launch_local(argv, options), 0) << GetParam().program;
    shardit::testing::expect_pngs_match(
        golden, shardit::io::image_paths(out, golden.batch),
        GetParam().program + (in_memory ? " (enable_parallelism)" : " (sharded on load)"));
  }
}

INSTANTIATE_TEST_SUITE_P(Pipelines, Examples,
                         ::testing::Values(ExampleCase{"flux_tp", "pipeline_flux1"},
                                           ExampleCase{"flux2_klein_tp", "pipeline_flux2_klein"},
                                           ExampleCase{"flux2_dev_tp", "pipeline_flux2_dev"},
                                           ExampleCase{"qwenimage_tp", "pipeline_qwenimage"}),
                         [](const auto& info) { return info.param.program; });

}  // namespace
}  // namespace test_examples
