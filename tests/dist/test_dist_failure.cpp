// Failure paths: a rank that dies mid-sequence (SIGKILL, or a silent exit), a rank that never
// arrives, bad environment values, and the local launcher stopping a job when one rank fails.
// Every surviving rank must fail with a message naming the lost rank, within the timeout.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "shardit/core/error.h"
#include "shardit/dist/launcher.h"
#include "shardit/dist/world.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_dist_failure {
namespace {

using shardit::dist::World;
using shardit::testing::env_or;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using ::testing::HasSubstr;

// The collective timeout the failure tests run with: a lost rank must be reported well within it.
constexpr int kTimeoutMs = 5000;
// Reporting adds the heartbeat probe (1 s) on top of the detection itself.
constexpr int64_t kReportBoundMs = kTimeoutMs + 2000;
// How long the launcher lets the survivors run after the first rank fails: past the report bound,
// so that a survivor slowed by other work on the cores is measured, not killed (the launcher's
// default, 5 s, is under the bound: a survivor that reported after 5 s wrote nothing).
constexpr int kSurvivorGraceSeconds = static_cast<int>(kReportBoundMs / 1000) + 3;

// CLOCK_MONOTONIC is shared by every process on the host, so ranks can compare timestamps.
int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path + ".tmp") << text;
  std::rename((path + ".tmp").c_str(), path.c_str());  // readers never see half a file
}


std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Survivor side: runs collectives until one throws, then records when and what, and exits 1.
// SIGTERM from the launcher (sent as soon as the dying rank exits) is ignored, so what is measured
// is the runtime's own detection, not the launcher's.
// Collectives until one throws (or four timeouts pass); writes "<when>\n<message>" to the rank's
// report file.
void collect_until_failure(const std::string& dir) {
  ::signal(SIGTERM, SIG_IGN);
  World& world = World::get();
  const int64_t give_up = now_ms() + 4 * kTimeoutMs;
  std::string message = "no error";
  while (now_ms() < give_up) {
    try {
      at::Tensor x = at::ones({64, 64});
      world.group()->all_reduce(x);
      world.group()->all_gather(x, 0);
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
      break;
    }
  }
  const int64_t failed_at = now_ms();
  write_file(dir + "/rank" + std::to_string(world.rank()),
             std::to_string(failed_at) + "\n" + message);
}

[[noreturn]] void run_until_failure(const std::string& dir) {
  collect_until_failure(dir);
  // Keep this process (and rank 0's store) up until every other survivor (all ranks but the one
  // that dies) has probed for the lost rank and written its report: a fixed pause was too short
  // for a survivor slowed by other work on the cores, which then found the store gone instead.
  World& world = World::get();
  const int64_t give_up = now_ms() + 4 * kTimeoutMs;
  const auto reports = [&] {
    int written = 0;
    for (int rank = 0; rank < world.size(); ++rank) written += !read_file(dir + "/rank" + std::to_string(rank)).empty();
    return written;
  };
  while (world.rank() == 0 && reports() < world.size() - 1 && now_ms() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::_Exit(1);
}

// Dying side: a few good collectives, then the timestamp, then death (or a stop: `signal` SIGSTOP).
void die_after_collectives(const std::string& dir, int signal) {
  World& world = World::get();
  for (int i = 0; i < 5; ++i) {  // the same sequence as run_until_failure's
    at::Tensor x = at::ones({64, 64});
    world.group()->all_reduce(x);
    world.group()->all_gather(x, 0);
  }
  write_file(dir + "/dying_pid", std::to_string(::getpid()));
  write_file(dir + "/death", std::to_string(now_ms()));
  if (signal != 0) ::raise(signal);
  std::_Exit(0);  // a silent exit with success: the others must still fail
}

void expect_survivor_report(const std::string& dir, int rank, int lost_rank) {
  const std::string death = read_file(dir + "/death");
  const std::string report = read_file(dir + "/rank" + std::to_string(rank));
  ASSERT_FALSE(death.empty()) << "the dying rank did not record its death";
  ASSERT_FALSE(report.empty()) << "rank " << rank << " wrote no report";
  const int64_t died_at = std::stoll(death);
  const int64_t failed_at = std::stoll(report.substr(0, report.find('\n')));
  const std::string message = report.substr(report.find('\n') + 1);
  EXPECT_LT(failed_at - died_at, kReportBoundMs) << "rank " << rank << ": " << message;
  EXPECT_THAT(message, HasSubstr("failed on rank " + std::to_string(rank)));
  EXPECT_THAT(message, HasSubstr("on group 'world'"));
  EXPECT_THAT(message, HasSubstr("lost rank " + std::to_string(lost_rank) + " (exited, crashed or was killed)"));
}

TEST(DistFailure, RankKilledMidSequence) {
  if (is_worker()) {
    const std::string dir = env_or("SHARDIT_TEST_DIR");
    World& world = World::init();
    if (world.rank() == 1) die_after_collectives(dir, SIGKILL);
    run_until_failure(dir);
  }
  const std::string dir = shardit::testing::make_temp_dir("dist-kill");
  const auto start = std::chrono::steady_clock::now();
  const int code =
      run_ranks(3, {{"SHARDIT_TEST_DIR", dir}, {"SHARDIT_DIST_TIMEOUT_MS", std::to_string(kTimeoutMs)}},
                kSurvivorGraceSeconds);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(code, 0);
  EXPECT_LT(seconds, 20.0);
  expect_survivor_report(dir, 0, 1);
  expect_survivor_report(dir, 2, 1);
}

TEST(DistFailure, RankExitsSilentlyMidSequence) {
  if (is_worker()) {
    const std::string dir = env_or("SHARDIT_TEST_DIR");
    World& world = World::init();
    if (world.rank() == 1) die_after_collectives(dir, 0);
    run_until_failure(dir);
  }
  const std::string dir = shardit::testing::make_temp_dir("dist-exit");
  const auto start = std::chrono::steady_clock::now();
  const int code =
      run_ranks(2, {{"SHARDIT_TEST_DIR", dir}, {"SHARDIT_DIST_TIMEOUT_MS", std::to_string(kTimeoutMs)}},
                kSurvivorGraceSeconds);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(code, 0) << "rank 0 should have failed after rank 1 left";
  EXPECT_LT(seconds, 20.0);
  expect_survivor_report(dir, 0, 1);
}

// A rank stopped by SIGSTOP is not dead: the survivor fails after the timeout and says that the
// process is stopped (it runs on the same host), not that it exited. The survivor then kills it.
TEST(DistFailure, StoppedRankIsReportedAsStopped) {
  if (is_worker()) {
    const std::string dir = env_or("SHARDIT_TEST_DIR");
    World& world = World::init();
    if (world.rank() == 1) die_after_collectives(dir, SIGSTOP);
    collect_until_failure(dir);
    ::kill(static_cast<pid_t>(std::stoll(read_file(dir + "/dying_pid"))), SIGKILL);
    std::_Exit(1);
  }
  const std::string dir = shardit::testing::make_temp_dir("dist-stop");
  const int code =
      run_ranks(2, {{"SHARDIT_TEST_DIR", dir}, {"SHARDIT_DIST_TIMEOUT_MS", std::to_string(kTimeoutMs)}},
                kSurvivorGraceSeconds);
  EXPECT_NE(code, 0);
  const std::string report = read_file(dir + "/rank0");
  ASSERT_FALSE(report.empty()) << "rank 0 wrote no report";
  EXPECT_THAT(report, HasSubstr("lost rank 1 (its process is stopped, by SIGSTOP or a debugger; SIGCONT resumes it)"));
  EXPECT_THAT(report, ::testing::Not(HasSubstr("exited, crashed or was killed")));
}

/// What the rank that waits at the rendezvous for an absent one saw: how long World::init took
/// and its error.
struct AbsentRankReport {
  int64_t elapsed_ms = -1;
  std::string message;
};

/// Two ranks, one of which (`absent`) never calls World::init: in a worker, the absent rank sleeps
/// past the timeout and the other records its rendezvous error, then both exit (never returns);
/// in the test process, runs the two and returns the report.
AbsentRankReport rendezvous_with_absent_rank(int absent, int timeout_ms, const std::string& dir_name) {
  if (is_worker()) {
    const std::string dir = env_or("SHARDIT_TEST_DIR");
    if (std::atoi(env_or("RANK").c_str()) == absent) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2 * timeout_ms));
      std::_Exit(0);
    }
    const int64_t start = now_ms();
    std::string message = "no error";
    try {
      World::init();
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
    write_file(dir + "/report", std::to_string(now_ms() - start) + "\n" + message);
    std::_Exit(1);
  }
  const std::string dir = shardit::testing::make_temp_dir(dir_name);
  const int code = run_ranks(2, {{"SHARDIT_TEST_DIR", dir}, {"SHARDIT_DIST_TIMEOUT_MS", std::to_string(timeout_ms)}});
  EXPECT_NE(code, 0);
  const std::string report = read_file(dir + "/report");
  if (report.empty()) {
    ADD_FAILURE() << "the waiting rank wrote no report";
    return {};
  }
  return {std::stoll(report.substr(0, report.find('\n'))), report.substr(report.find('\n') + 1)};
}

TEST(DistFailure, RankThatNeverArrivesTimesOut) {
  constexpr int kRendezvousMs = 3000;
  const AbsentRankReport report = rendezvous_with_absent_rank(1, kRendezvousMs, "dist-absent");
  // The wait is the timeout (+0.5 s that rank 0 keeps its store up for the others).
  EXPECT_GE(report.elapsed_ms, kRendezvousMs - 100) << report.message;
  EXPECT_LT(report.elapsed_ms, kRendezvousMs + 2000) << report.message;
  EXPECT_THAT(report.message, HasSubstr("rank 0 of 2 (torchrun): rendezvous at 127.0.0.1:"));
  EXPECT_THAT(report.message, HasSubstr("failed within 3000 ms: rank 1 did not join"));
}

// The mirror case: rank 0, which hosts the store, never starts it. Rank 1 waits for a listener
// (in short steps, not c10d's one-second retries) up to the timeout, then says that nothing
// listens, within the timeout rather than after a second one of c10d's own.
TEST(DistFailure, StoreThatNeverListensIsNamedWithinTheTimeout) {
  constexpr int kRendezvousMs = 2000;
  const AbsentRankReport report = rendezvous_with_absent_rank(0, kRendezvousMs, "dist-no-store");
  EXPECT_GE(report.elapsed_ms, kRendezvousMs - 100) << report.message;
  EXPECT_LT(report.elapsed_ms, kRendezvousMs + 1000) << report.message;
  EXPECT_THAT(report.message, HasSubstr("rank 1 of 2 (torchrun): rendezvous at 127.0.0.1:"));
  EXPECT_THAT(report.message, HasSubstr("failed within 2000 ms: nothing listens there (rank 0 hosts the store)"));
}

// Sets variables for one call and restores the environment after.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::map<std::string, std::string> vars) : vars_(std::move(vars)) {
    for (const auto& [name, value] : vars_) setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : vars_) unsetenv(name.c_str());
  }

 private:
  std::map<std::string, std::string> vars_;
};

std::string init_error(std::map<std::string, std::string> vars, shardit::dist::InitOptions options = {}) {
  ScopedEnv env(std::move(vars));
  try {
    World::init(options);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

TEST(DistFailure, BadEnvironmentFailsInit) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  EXPECT_THAT(init_error({{"RANK", "3"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}}),
              HasSubstr("RANK=3 is out of range for WORLD_SIZE=2 (expected 0..1)"));
  EXPECT_THAT(init_error({{"RANK", "0"}, {"WORLD_SIZE", "0"}}),
              HasSubstr("WORLD_SIZE=0 is invalid: the world needs at least 1 rank"));
  EXPECT_THAT(init_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}}),
              HasSubstr("MASTER_PORT='http' is not an integer"));
  EXPECT_THAT(init_error({{"SHARDIT_DIST_TIMEOUT_MS", "soon"}}),
              HasSubstr("SHARDIT_DIST_TIMEOUT_MS='soon' is invalid: expected milliseconds"));
  shardit::dist::InitOptions gpu;
  gpu.device = "gpu";
  EXPECT_THAT(init_error({}, gpu), HasSubstr("device 'gpu' is not supported: use auto, cpu or cuda"));
  EXPECT_FALSE(World::initialized());
}

// Runs launch_local with this process's stdout and stderr captured into files.
int launch_captured(const std::vector<std::string>& argv, const shardit::dist::LocalLaunchOptions& options,
                    std::string* out, std::string* err) {
  const std::string dir = shardit::testing::make_temp_dir("launch");
  std::fflush(stdout);
  std::fflush(stderr);
  const int saved_out = ::dup(1);
  const int saved_err = ::dup(2);
  const int out_fd = ::open((dir + "/out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int err_fd = ::open((dir + "/err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(out_fd, 1);
  ::dup2(err_fd, 2);
  const int code = shardit::dist::launch_local(argv, options);
  ::dup2(saved_out, 1);
  ::dup2(saved_err, 2);
  for (int fd : {saved_out, saved_err, out_fd, err_fd}) ::close(fd);
  *out = read_file(dir + "/out");
  *err = read_file(dir + "/err");
  return code;
}

TEST(DistLauncher, PrefixesOutputAndSetsTheEnvironment) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  std::string out, err;
  shardit::dist::LocalLaunchOptions options;
  options.nproc = 2;
  const int code = launch_captured(
      {"/bin/sh", "-c",
       "echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR\"; "
       "echo \"warn $RANK\" >&2; printf 'no newline'"},
      options, &out, &err);
  EXPECT_EQ(code, 0) << err;
  EXPECT_THAT(out, HasSubstr("[0] env 0 2 0 2 127.0.0.1\n"));
  EXPECT_THAT(out, HasSubstr("[1] env 1 2 1 2 127.0.0.1\n"));
  EXPECT_THAT(out, HasSubstr("[1] no newline\n"));
  EXPECT_THAT(err, HasSubstr("[0] warn 0\n"));
  EXPECT_THAT(err, HasSubstr("[1] warn 1\n"));
}

TEST(DistLauncher, StopsTheOthersWhenARankFails) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  std::string out, err;
  shardit::dist::LocalLaunchOptions options;
  options.nproc = 3;
  const auto start = std::chrono::steady_clock::now();
  const int code = launch_captured(
      {"/bin/sh", "-c", "if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 3; fi; exec sleep 60"}, options,
      &out, &err);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(code, 3);
  EXPECT_LT(seconds, 10.0);
  EXPECT_THAT(err, HasSubstr("shardit: rank 1 failed (exit code 3); stopping the other ranks"));
}

TEST(DistLauncher, KillsRanksThatIgnoreSigtermAfterTheGracePeriod) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  std::string out, err;
  shardit::dist::LocalLaunchOptions options;
  options.nproc = 2;
  options.grace_seconds = 1;
  const auto start = std::chrono::steady_clock::now();
  const int code = launch_captured(
      {"/bin/sh", "-c",
       "trap '' TERM; if [ \"$RANK\" = 0 ]; then sleep 0.3; kill -9 $$; fi; sleep 60"},
      options, &out, &err);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(code, 128 + SIGKILL);
  EXPECT_GE(seconds, 1.0);  // rank 1 ignored SIGTERM and lived through the grace period
  EXPECT_LT(seconds, 10.0);
  EXPECT_THAT(err, HasSubstr("shardit: rank 0 failed (killed by signal 9"));
  EXPECT_THAT(err, HasSubstr("); stopping the other ranks"));
}

TEST(DistLauncher, ForwardsSigtermToEveryRank) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  std::string out, err;
  shardit::dist::LocalLaunchOptions options;
  options.nproc = 2;
  // SIGTERM to the launcher (this process) once the ranks are up; its handler must forward it.
  std::thread terminator([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    ::kill(::getpid(), SIGTERM);
  });
  const auto start = std::chrono::steady_clock::now();
  const int code = launch_captured(
      {"/bin/sh", "-c", "trap 'echo \"rank $RANK got TERM\"; exit 7' TERM; sleep 60 & wait"}, options, &out,
      &err);
  terminator.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(code, 0);
  EXPECT_LT(seconds, 10.0);
  EXPECT_THAT(out, HasSubstr("[0] rank 0 got TERM"));
  EXPECT_THAT(out, HasSubstr("[1] rank 1 got TERM"));
}

// A signal to the launcher is the user's: the ranks get the time they need to finish (a server
// answers its running request), however long past the failure grace period; a second signal
// kills them at once.
TEST(DistLauncher, RanksGetTheirTimeAfterASignalAndASecondOneKillsThem) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  std::string out, err;
  shardit::dist::LocalLaunchOptions options;
  options.nproc = 2;
  options.grace_seconds = 1;
  std::thread terminator([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    ::kill(::getpid(), SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // 2.5 grace periods
    ::kill(::getpid(), SIGTERM);
  });
  const auto start = std::chrono::steady_clock::now();
  const int code =
      launch_captured({"/bin/sh", "-c", "trap 'echo \"rank $RANK got TERM\"' TERM; sleep 60 & wait; sleep 60"},
                      options, &out, &err);
  terminator.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(code, 128 + SIGKILL);
  EXPECT_GE(seconds, 3.5) << "the ranks were killed before the second signal";
  EXPECT_LT(seconds, 10.0);
  EXPECT_THAT(out, HasSubstr("[0] rank 0 got TERM"));
  EXPECT_THAT(err, HasSubstr("shardit: a second signal: killing the ranks"));
}

}  // namespace
}  // namespace test_dist_failure
