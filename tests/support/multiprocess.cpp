#include "support/multiprocess.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "shardit/dist/launcher.h"
#include "support/test_support.h"

namespace shardit::testing {

namespace {

constexpr const char* kRecordDirVariable = "SHARDIT_TEST_RECORD_DIR";

// One line per event, appended to <record dir>/<pid>: "started <test>", then "skipped",
// "passed" or "failed". A rank that dies inside the test leaves only the first line.
class WorkerRecorder : public ::testing::EmptyTestEventListener {
 public:
  explicit WorkerRecorder(std::string path) : path_(std::move(path)) {}
  void OnTestStart(const ::testing::TestInfo& info) override {
    append(std::string("started ") + info.test_suite_name() + "." + info.name());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    const ::testing::TestResult& result = *info.result();
    append(result.Skipped() ? "skipped" : result.Failed() ? "failed" : "passed");
  }

 private:
  void append(const std::string& line) {
    // Flushed and closed at once: the line survives a rank that is killed right after.
    std::ofstream(path_, std::ios::app) << line << "\n" << std::flush;
  }
  std::string path_;
};

// Installed before main() in every worker that has a record folder.
const bool kRecorderInstalled = [] {
  const std::string dir = env_or(kRecordDirVariable);
  if (is_worker() && !dir.empty()) {
    ::testing::UnitTest::GetInstance()->listeners().Append(
        new WorkerRecorder(dir + "/" + std::to_string(::getpid())));
  }
  return true;
}();

std::vector<std::string> lines_of(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

bool is_worker() { return env_or("SHARDIT_TEST_WORKER") == "1"; }

std::string env_or(const std::string& name, const std::string& fallback) {
  const char* value = std::getenv(name.c_str());
  return value ? value : fallback;
}

std::string current_test_name() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) throw std::logic_error("current_test_name() called outside a test");
  return std::string(info->test_suite_name()) + "." + info->name();
}

WorkerRecord::WorkerRecord() : test_(current_test_name()), dir_(make_temp_dir("workers")) {}

std::map<std::string, std::string> WorkerRecord::env() const {
  return {{"SHARDIT_TEST_WORKER", "1"}, {kRecordDirVariable, dir_}};
}

void WorkerRecord::expect_ran(int nproc) const {
  int started = 0;
  std::ostringstream problems;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    const std::vector<std::string> lines = lines_of(entry.path());
    const std::string process = "worker process " + entry.path().filename().string();
    if (lines.empty() || lines[0] != "started " + test_) {
      problems << "\n  " << process << " ran '" << (lines.empty() ? "" : lines[0]) << "', not '" << test_ << "'";
      continue;
    }
    ++started;
    if (lines.size() > 1 && lines[1] == "skipped") problems << "\n  " << process << " skipped the test";
    if (lines.size() > 2) problems << "\n  " << process << " ran more than one test";
  }
  if (started != nproc) {
    problems << "\n  " << started << " of " << nproc << " workers started '" << test_
             << "' (a worker whose --gtest_filter matches no test exits 0 without running anything)";
  }
  if (!problems.str().empty()) ADD_FAILURE() << "multi-process test '" << test_ << "':" << problems.str();
}

int run_ranks(int nproc, std::map<std::string, std::string> extra_env) {
  const WorkerRecord record;
  for (const auto& [name, value] : record.env()) extra_env[name] = value;
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
      dist::launch_local({dist::current_executable(), "--gtest_filter=" + current_test_name()}, options);
  for (const auto& [name, old] : saved) {
    if (old) {
      setenv(name.c_str(), old->c_str(), 1);
    } else {
      unsetenv(name.c_str());
    }
  }
  record.expect_ran(nproc);
  return code;
}

}  // namespace shardit::testing
