// Failure paths: a rank that dies mid-sequence (SIGKILL, or a silent exit), a rank that never
// arrives, bad environment values, and the local launcher stopping a job when one rank fails.
// Every surviving rank must fail with a message naming the lost rank, rather than hang.
// The cases wait on events (a rank's report in a file, a file a rank creates when it is ready, the
// launcher's exit), never on a clock: a deadline of minutes only ends a hung case.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

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
using shardit::testing::poll_until;
using shardit::testing::RankContext;
using shardit::testing::run_on_ranks;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// The collective timeout the failure tests run with. A killed rank is detected without it (its
// connections reset); a stopped one only by it. Long enough that a healthy collective on a busy
// machine never reaches it.
constexpr std::chrono::milliseconds kTimeout{10000};
// Only a hung case waits this long: for a survivor's report, for a file a rank creates, and (as
// the launcher's grace period) before the launcher kills survivors that ignore SIGTERM. A survivor
// exits on its own once it has reported, so the grace period only ends a hung one.
using shardit::testing::kHangDeadline;
constexpr int kHangSeconds = static_cast<int>(std::chrono::seconds(kHangDeadline).count());

shardit::dist::InitOptions with_timeout(std::chrono::milliseconds timeout) {
  shardit::dist::InitOptions options;
  options.timeout = timeout;
  return options;
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

// Survivor side: runs collectives until one throws, then writes its message to the rank's report
// file. SIGTERM from the launcher (sent as soon as the dying rank exits) is ignored, so what is
// checked is the runtime's own detection, not the launcher's.
void collect_until_failure(const std::string& dir) {
  ::signal(SIGTERM, SIG_IGN);
  World& world = World::get();
  std::string message = "no error: the collectives went on succeeding after the other rank left";
  const auto give_up = Clock::now() + kHangDeadline / 2;  // within the launcher's grace period
  while (Clock::now() < give_up) {
    try {
      at::Tensor x = at::ones({64, 64});
      world.group()->all_reduce(x);
      world.group()->all_gather(x, 0);
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
      break;
    }
  }
  write_file(dir + "/rank" + std::to_string(world.rank()), message);
}

[[noreturn]] void run_until_failure(const std::string& dir) {
  collect_until_failure(dir);
  // Keep this process (and rank 0's store) up until every other survivor (all ranks but the one
  // that dies) has probed for the lost rank and written its report: without the store, a survivor
  // would find it gone instead of the lost rank.
  World& world = World::get();
  if (world.rank() == 0) {
    poll_until([&] {
      int written = 0;
      for (int rank = 0; rank < world.size(); ++rank) written += !read_file(dir + "/rank" + std::to_string(rank)).empty();
      return written >= world.size() - 1;
    });
  }
  std::_Exit(1);
}

// Dying side: a few good collectives, then its pid for the others, then death (or a stop:
// `signal` SIGSTOP).
void die_after_collectives(const std::string& dir, int signal) {
  World& world = World::get();
  for (int i = 0; i < 5; ++i) {  // the same sequence as run_until_failure's
    at::Tensor x = at::ones({64, 64});
    world.group()->all_reduce(x);
    world.group()->all_gather(x, 0);
  }
  write_file(dir + "/dying_pid", std::to_string(::getpid()));
  if (signal != 0) ::raise(signal);
  std::_Exit(0);  // a silent exit with success: the others must still fail
}

// The survivor's report names the lost rank, found by the heartbeat probe: the runtime noticed the
// loss and said which rank it was, rather than hanging or blaming no one.
void expect_survivor_report(const std::string& dir, int rank, int lost_rank) {
  ASSERT_FALSE(read_file(dir + "/dying_pid").empty()) << "the dying rank did not get through its collectives";
  const std::string message = read_file(dir + "/rank" + std::to_string(rank));
  ASSERT_FALSE(message.empty()) << "rank " << rank << " wrote no report";
  EXPECT_THAT(message, HasSubstr("failed on rank " + std::to_string(rank)));
  EXPECT_THAT(message, HasSubstr("on group 'world'"));
  EXPECT_THAT(message, HasSubstr("lost rank " + std::to_string(lost_rank) + " (exited, crashed or was killed)"));
}

TEST(DistFailure, RankKilledMidSequence) {
  const auto run = run_on_ranks(
      3,
      [](const RankContext& ranks) {
        World& world = World::init(with_timeout(kTimeout));
        if (world.rank() == 1) die_after_collectives(ranks.dir, SIGKILL);
        run_until_failure(ranks.dir);
      },
      kHangSeconds);
  EXPECT_NE(run.exit_code, 0);
  expect_survivor_report(run.dir, 0, 1);
  expect_survivor_report(run.dir, 2, 1);
}

TEST(DistFailure, RankExitsSilentlyMidSequence) {
  const auto run = run_on_ranks(
      2,
      [](const RankContext& ranks) {
        World& world = World::init(with_timeout(kTimeout));
        if (world.rank() == 1) die_after_collectives(ranks.dir, 0);
        run_until_failure(ranks.dir);
      },
      kHangSeconds);
  EXPECT_NE(run.exit_code, 0) << "rank 0 should have failed after rank 1 left";
  expect_survivor_report(run.dir, 0, 1);
}

// A rank stopped by SIGSTOP is not dead: the survivor fails after the timeout and says that the
// process is stopped (it runs on the same host), not that it exited. The survivor then kills it.
TEST(DistFailure, StoppedRankIsReportedAsStopped) {
  const auto run = run_on_ranks(
      2,
      [](const RankContext& ranks) {
        World& world = World::init(with_timeout(kTimeout));
        if (world.rank() == 1) die_after_collectives(ranks.dir, SIGSTOP);
        collect_until_failure(ranks.dir);
        ::kill(static_cast<pid_t>(std::stoll(read_file(ranks.dir + "/dying_pid"))), SIGKILL);
        std::_Exit(1);
      },
      kHangSeconds);
  EXPECT_NE(run.exit_code, 0);
  const std::string report = read_file(run.dir + "/rank0");
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

/// Two ranks, one of which (`absent`) never calls World::init: the other records its rendezvous
/// error and how long it waited; the absent one stays up until that report is written, then both
/// exit. Returns the report.
AbsentRankReport rendezvous_with_absent_rank(int absent, std::chrono::milliseconds timeout) {
  const auto run = run_on_ranks(2, [absent, timeout](const RankContext& ranks) {
    const std::string report = ranks.dir + "/report";
    if (std::atoi(env_or("RANK").c_str()) == absent) {
      poll_until([&] { return std::filesystem::exists(report); });
      std::_Exit(0);
    }
    const auto start = Clock::now();
    std::string message = "no error";
    try {
      World::init(with_timeout(timeout));
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
    const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    write_file(report, std::to_string(elapsed.count()) + "\n" + message);
    std::_Exit(1);
  });
  EXPECT_NE(run.exit_code, 0);
  const std::string report = read_file(run.dir + "/report");
  if (report.empty()) {
    ADD_FAILURE() << "the waiting rank wrote no report";
    return {};
  }
  return {std::stoll(report.substr(0, report.find('\n'))), report.substr(report.find('\n') + 1)};
}

// The rank that waits says who did not join, after the whole timeout (a lower bound: it did not
// give up early; how much longer it took is the machine's business).
TEST(DistFailure, RankThatNeverArrivesTimesOut) {
  constexpr std::chrono::milliseconds kRendezvous{3000};
  const AbsentRankReport report = rendezvous_with_absent_rank(1, kRendezvous);
  EXPECT_GE(report.elapsed_ms, kRendezvous.count() - 100) << report.message;
  EXPECT_THAT(report.message, HasSubstr("rank 0 of 2 (torchrun): rendezvous at 127.0.0.1:"));
  EXPECT_THAT(report.message, HasSubstr("failed within 3000 ms: rank 1 did not join"));
}

// The mirror case: rank 0, which hosts the store, never starts it. Rank 1 waits for a listener
// (in short steps, not c10d's one-second retries) up to the timeout, then says that nothing
// listens: that message comes from its own wait, which ends at the timeout, not from c10d's
// connect, which would wait a timeout of its own after it.
TEST(DistFailure, StoreThatNeverListensIsNamedWithinTheTimeout) {
  constexpr std::chrono::milliseconds kRendezvous{2000};
  const AbsentRankReport report = rendezvous_with_absent_rank(0, kRendezvous);
  EXPECT_GE(report.elapsed_ms, kRendezvous.count() - 100) << report.message;
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

// A shell command that waits until every file of `paths` exists, polling; after the hang deadline
// it says so on stderr and exits 99 (only a hung case gets there).
std::string shell_wait_for(const std::vector<std::string>& paths) {
  std::string all;
  for (const std::string& path : paths) all += (all.empty() ? "" : " && ") + std::string("[ -e '") + path + "' ]";
  return "n=0; until " + all + "; do n=$((n + 1)); if [ $n -gt " + std::to_string(kHangSeconds * 20) +
         " ]; then echo 'hung: waited for " + paths.front() + "' >&2; exit 99; fi; sleep 0.05; done; ";
}

// In the test process, from another thread: waits until every file of `paths` exists, then sends
// SIGTERM to this process (the launcher); false (nothing sent) when the launch ended first or the
// hang deadline passed.
bool terminate_once_present(const std::vector<std::string>& paths, const std::atomic<bool>& launch_ended) {
  const bool present = poll_until([&] {
    if (launch_ended) return true;
    for (const std::string& path : paths) {
      if (!std::filesystem::exists(path)) return false;
    }
    return true;
  });
  if (!present || launch_ended) return false;
  ::kill(::getpid(), SIGTERM);
  return true;
}

// Rank 1 fails once the others are up (each has set its SIGTERM trap and said so in a file); the
// launcher must stop the others with SIGTERM, which they report, rather than wait for them.
TEST(DistLauncher, StopsTheOthersWhenARankFails) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  const std::string dir = shardit::testing::make_temp_dir("launch-stop");
  std::string out, err;
  shardit::dist::LocalLaunchOptions options;
  options.nproc = 3;
  const int code = launch_captured(
      {"/bin/sh", "-c",
       "trap 'echo \"rank $RANK got TERM\"; exit 143' TERM; touch " + dir + "/ready.$RANK; "
       "if [ \"$RANK\" = 1 ]; then " + shell_wait_for({dir + "/ready.0", dir + "/ready.2"}) + "exit 3; fi; "
       "sleep " + std::to_string(kHangSeconds) + " & wait; echo \"rank $RANK was never stopped\""},
      options, &out, &err);
  EXPECT_EQ(code, 3) << err;
  EXPECT_THAT(err, HasSubstr("shardit: rank 1 failed (exit code 3); stopping the other ranks"));
  EXPECT_THAT(out, HasSubstr("[0] rank 0 got TERM"));
  EXPECT_THAT(out, HasSubstr("[2] rank 2 got TERM"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("never stopped")));
}

// Rank 1 ignores SIGTERM: after the grace period the launcher kills it (it never gets to say that
// it outlived the launcher). The elapsed time has a lower bound only: the grace period was given.
TEST(DistLauncher, KillsRanksThatIgnoreSigtermAfterTheGracePeriod) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  const std::string dir = shardit::testing::make_temp_dir("launch-kill");
  std::string out, err;
  shardit::dist::LocalLaunchOptions options;
  options.nproc = 2;
  options.grace_seconds = 1;
  const auto start = Clock::now();
  const int code = launch_captured(
      {"/bin/sh", "-c",
       "if [ \"$RANK\" = 1 ]; then trap '' TERM; touch " + dir + "/ready; sleep " + std::to_string(kHangSeconds) +
           "; echo 'rank 1 was not killed'; exit 0; fi; " + shell_wait_for({dir + "/ready"}) + "kill -9 $$"},
      options, &out, &err);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(code, 128 + SIGKILL);
  EXPECT_GE(seconds, 1.0);  // rank 1 ignored SIGTERM and lived through the grace period
  EXPECT_THAT(err, HasSubstr("shardit: rank 0 failed (killed by signal 9"));
  EXPECT_THAT(err, HasSubstr("); stopping the other ranks"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("was not killed")));
}

// SIGTERM to the launcher (this process) once both ranks have set their trap: its handler must
// forward it to each of them.
TEST(DistLauncher, ForwardsSigtermToEveryRank) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  const std::string dir = shardit::testing::make_temp_dir("launch-forward");
  std::string out, err;
  shardit::dist::LocalLaunchOptions options;
  options.nproc = 2;
  std::atomic<bool> launch_ended{false};
  bool signalled = false;
  std::thread terminator(
      [&] { signalled = terminate_once_present({dir + "/ready.0", dir + "/ready.1"}, launch_ended); });
  const int code = launch_captured(
      {"/bin/sh", "-c",
       "trap 'echo \"rank $RANK got TERM\"; exit 7' TERM; touch " + dir + "/ready.$RANK; sleep " +
           std::to_string(kHangSeconds) + " & wait; echo \"rank $RANK got no signal\""},
      options, &out, &err);
  launch_ended = true;
  terminator.join();
  ASSERT_TRUE(signalled) << "the ranks never became ready:\n" << out << err;
  EXPECT_NE(code, 0);
  EXPECT_THAT(out, HasSubstr("[0] rank 0 got TERM"));
  EXPECT_THAT(out, HasSubstr("[1] rank 1 got TERM"));
}

// A signal to the launcher is the user's: the ranks get the time they need to finish (a server
// answers its running request), however long past the failure grace period; a second signal
// kills them at once. Each rank, once signalled, stays up for 2.5 grace periods and then says it
// is still alive; only then does the second signal come.
TEST(DistLauncher, RanksGetTheirTimeAfterASignalAndASecondOneKillsThem) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  const std::string dir = shardit::testing::make_temp_dir("launch-second");
  std::string out, err;
  shardit::dist::LocalLaunchOptions options;
  options.nproc = 2;
  options.grace_seconds = 1;
  std::atomic<bool> launch_ended{false};
  bool first = false, second = false;
  std::thread terminator([&] {
    first = terminate_once_present({dir + "/ready.0", dir + "/ready.1"}, launch_ended);
    if (first) second = terminate_once_present({dir + "/alive.0", dir + "/alive.1"}, launch_ended);
  });
  const std::string hang = std::to_string(kHangSeconds);
  // The rank's whole answer to the first signal is in its trap: a signal that comes before the
  // shell reaches `wait` runs the trap at once, rather than leaving the rank waiting for its sleep.
  const int code = launch_captured(
      {"/bin/sh", "-c",
       "trap 'echo \"rank $RANK got TERM\"; sleep 2.5; touch " + dir + "/alive.$RANK; sleep " + hang +
           " & wait; echo \"rank $RANK was not killed\"; exit 0' TERM; touch " + dir + "/ready.$RANK; sleep " + hang +
           " & wait; echo \"rank $RANK got no signal\""},
      options, &out, &err);
  launch_ended = true;
  terminator.join();
  ASSERT_TRUE(first) << "the ranks never became ready:\n" << out << err;
  EXPECT_TRUE(second) << "the ranks were killed before the second signal:\n" << out << err;
  EXPECT_EQ(code, 128 + SIGKILL);
  EXPECT_THAT(out, HasSubstr("[0] rank 0 got TERM"));
  EXPECT_THAT(err, HasSubstr("shardit: a second signal: killing the ranks"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("was not killed")));
}

}  // namespace
}  // namespace test_dist_failure
