#include "support/multiprocess.h"

#include <cstdlib>
#include <optional>
#include <vector>

#include "shardit/dist/launcher.h"

namespace shardit::testing {

bool is_worker() { return env_or("SHARDIT_TEST_WORKER") == "1"; }

std::string env_or(const std::string& name, const std::string& fallback) {
  const char* value = std::getenv(name.c_str());
  return value ? value : fallback;
}

int run_ranks(int nproc, const std::string& test_name, std::map<std::string, std::string> extra_env) {
  extra_env["SHARDIT_TEST_WORKER"] = "1";
  // The ranks inherit this process's environment: set the extra variables for the launch only.
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const auto& [name, value] : extra_env) {
    const char* old = std::getenv(name.c_str());
    saved.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    setenv(name.c_str(), value.c_str(), 1);
  }
  dist::LocalLaunchOptions options;
  options.nproc = nproc;
  const int code =
      dist::launch_local({dist::current_executable(), "--gtest_filter=" + test_name}, options);
  for (const auto& [name, old] : saved) {
    if (old) {
      setenv(name.c_str(), old->c_str(), 1);
    } else {
      unsetenv(name.c_str());
    }
  }
  return code;
}

}  // namespace shardit::testing
