// Keeps the layers honest: core -> io, dist -> nn -> parallel -> models -> pipelines -> apps,
// and core -> io -> tokenizers (a sibling of nn: neither includes the other).
// A file may include only its own layer and the layers below it (io and dist are siblings and
// must not include each other).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

namespace test_layering {
namespace {

namespace fs = std::filesystem;

// Rank of each layer; a file may include a layer of lower rank, or its own layer.
const std::map<std::string, int> kLayerRank = {
    {"core", 0}, {"io", 1}, {"dist", 1}, {"nn", 2}, {"tokenizers", 2}, {"schedulers", 2}, {"parallel", 3},
    {"models", 4}, {"verify", 5}, {"pipelines", 5}, {"serving", 6},
};

std::vector<std::string> upward_includes() {
  const fs::path root = fs::path(SHARDIT_SOURCE_DIR) / "src" / "shardit";
  const std::regex include_re(R"re(^\s*#\s*include\s*"shardit/([a-z_]+)/)re");
  std::vector<std::string> violations;
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    if (!entry.is_regular_file()) continue;
    const auto ext = entry.path().extension();
    if (ext != ".h" && ext != ".cpp") continue;
    const std::string layer = fs::relative(entry.path(), root).begin()->string();
    const auto own = kLayerRank.find(layer);
    if (own == kLayerRank.end()) {
      violations.push_back(entry.path().string() + ": folder '" + layer + "' is not a known layer");
      continue;
    }
    std::ifstream in(entry.path());
    std::string line;
    int line_number = 0;
    while (std::getline(in, line)) {
      ++line_number;
      std::smatch match;
      if (!std::regex_search(line, match, include_re)) continue;
      const std::string included = match[1];
      const auto target = kLayerRank.find(included);
      const bool ok = target != kLayerRank.end() &&
                      (included == layer || target->second < own->second);
      if (!ok) {
        violations.push_back(fs::relative(entry.path(), root).string() + ":" +
                             std::to_string(line_number) + " (" + layer + ") includes " + included);
      }
    }
  }
  return violations;
}

TEST(Layering, NoUpwardIncludes) {
  const auto violations = upward_includes();
  std::string report;
  for (const auto& v : violations) report += "  " + v + "\n";
  EXPECT_TRUE(violations.empty()) << "includes against the layer order:\n" << report;
}

}  // namespace
}  // namespace test_layering
