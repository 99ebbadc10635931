// `shardit version` (and `shardit --version`): shardit's version, the LibTorch it was built with
// and runs with, the CUDA and NCCL compiled in, the collective backends, the CPU's features and
// the kernels it computes with here (nn/build_info.h); --json prints the same as one object, as the
// bench writes it.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <string>

#include "apps/commands.h"
#include "shardit/nn/build_info.h"

namespace shardit::apps {

std::string version_text() {
  const auto facts = nn::build_facts();
  size_t width = 0;
  for (const auto& fact : facts) width = std::max(width, fact.first.size());
  std::string text;
  for (const auto& [name, value] : facts) text += fmt::format("{:<{}}  {}\n", name + ":", width + 1, value);
  return text;
}

void register_version(CLI::App& app, CommandBody& body) {
  auto json = std::make_shared<bool>(false);
  CLI::App* command = app.add_subcommand(
      "version", "shardit's version, its LibTorch (built with, running), CUDA, NCCL, collectives and CPU kernels");
  command->add_flag("--json", *json, "print the facts as one JSON object");
  command->callback([&body, json] {
    body = [json] {
      if (*json) {
        fmt::print("{}\n", nn::build_facts_json().dump(2));
      } else {
        fmt::print("{}", version_text());
      }
      return 0;
    };
  });
  // CLI11 prints the text with a line end of its own.
  app.set_version_flag("--version", [] {
    std::string text = version_text();
    if (!text.empty() && text.back() == '\n') text.pop_back();
    return text;
  });
}

}  // namespace shardit::apps
