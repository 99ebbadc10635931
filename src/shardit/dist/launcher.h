#pragma once
// The built-in local launcher (like `torchrun --standalone --nproc-per-node N`).
#include <signal.h>
#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

namespace shardit::dist {

/// The most ranks the local launcher starts on one host. Each rank is a full process (~60 MB
/// before any model is loaded); more than this is a typo rather than a plan.
constexpr int kMaxLocalRanks = 64;

struct LocalLaunchOptions {
  int nproc = 1;
  /// Prefix every output line of rank r with "[r] ".
  bool prefix_output = true;
  /// Seconds to wait for the other ranks to exit after one failed, before SIGKILL. A SIGINT or
  /// SIGTERM to the launcher is forwarded to the ranks, which then take the time they need; a
  /// second one SIGKILLs them.
  int grace_seconds = 5;
  /// How a rank is started when not by fork+exec of argv (the default, when empty): given the
  /// rank's argv, its whole environment ("NAME=value") and the descriptors its stdout and stderr
  /// go to (-1: this process's own), returns the pid of a child of this process in its own
  /// process group, which dies with this process (PR_SET_PDEATHSIG), or -1 with `error` set.
  /// The tests start their ranks this way from a process that has already initialised LibTorch.
  std::function<pid_t(const std::vector<std::string>& argv, const std::vector<std::string>& env, int out_fd,
                      int err_fd, std::string& error)>
      spawn;
  /// The program's own entry point for a rank's command line, when the ranks run this program:
  /// if the launcher has no other thread, each rank is forked and runs `run_rank(argv)` in the
  /// child (with the rank's environment, process group, signals and output set up as for exec)
  /// instead of executing the program again, which saves each rank the program's start-up
  /// (~0.35 CPU-s of LibTorch's static initialisation). With threads, or when empty, ranks are
  /// executed. Not used with `spawn`.
  std::function<int(const std::vector<std::string>& argv)> run_rank;
};

/// Runs `argv` (argv[0] is the program; a path, or the current executable when empty) as `nproc`
/// ranks on this host with RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR=127.0.0.1 and a
/// free MASTER_PORT set. Forwards SIGINT/SIGTERM/SIGHUP to the ranks (one that arrives while ranks
/// are still being started stops the starting). When a rank fails, stops the others and reports
/// which rank failed and how. Each rank is killed by the kernel when the launcher dies
/// (PR_SET_PDEATHSIG), so a SIGKILLed launcher leaves no rank running. Returns 0 when every rank
/// exited 0, else non-zero. `nproc` must be in 1..kMaxLocalRanks.
int launch_local(const std::vector<std::string>& argv, const LocalLaunchOptions& options);

/// The SIGTERM with which the local launcher stops the other ranks after rank `rank` failed carries
/// that rank and how it ended (sigqueue's value), so that a rank that handles SIGTERM can tell this
/// stop from one a user asked for (a server then fails naming the rank instead of shutting down).
struct FailureNotice {
  int rank = 0;
  int wait_status = 0;  ///< as waitpid gave it
  /// "killed by signal 9 (Killed)" or "exit code 3".
  std::string how() const;
};

/// The sigqueue value for `notice` (at most 65535 ranks; the launcher starts kMaxLocalRanks).
int encode_failure_notice(const FailureNotice& notice);

/// Whether `info` (a SIGTERM's, from an SA_SIGINFO handler) is the launcher's failure notice: queued
/// by this process's parent with the notice's mark. Async-signal-safe.
bool is_failure_notice(const siginfo_t* info);

/// The notice a value of encode_failure_notice holds.
FailureNotice decode_failure_notice(int value);

/// The path of the running executable (/proc/self/exe).
std::string current_executable();

/// Re-runs the current command line (`argc`/`argv` of main) as `nproc` local ranks through
/// launch_local, with the `option` flag and its value (`--nproc-per-node N` or
/// `--nproc-per-node=N`) removed. Returns launch_local's exit code.
/// `run_rank`, when given, is the program's entry point for a rank's command line (see
/// LocalLaunchOptions::run_rank).
int relaunch_as_local_ranks(int argc, char** argv, int nproc, const std::string& option = "--nproc-per-node",
                            std::function<int(const std::vector<std::string>& argv)> run_rank = {});

}  // namespace shardit::dist
