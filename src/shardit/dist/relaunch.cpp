#include "shardit/dist/launcher.h"

namespace shardit::dist {

int relaunch_as_local_ranks(int argc, char** argv, int nproc, const std::string& option,
                            std::function<int(const std::vector<std::string>& argv)> run_rank) {
  std::vector<std::string> child_argv{current_executable()};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == option) {
      ++i;  // and its value
      continue;
    }
    if (arg.rfind(option + "=", 0) == 0) continue;
    child_argv.push_back(arg);
  }
  LocalLaunchOptions options;
  options.nproc = nproc;
  options.run_rank = std::move(run_rank);
  return launch_local(child_argv, options);
}

}  // namespace shardit::dist
