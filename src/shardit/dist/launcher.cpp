// The local launcher: fork+exec of N ranks, or fork alone into the program's own entry point when
// this process has no other thread (never fork without exec from a threaded process: OpenMP and
// LibTorch threads do not survive it), or a caller's own `spawn`; their output prefixed line by
// line, signals forwarded, and the whole job stopped when one rank fails.
#include "shardit/dist/launcher.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

extern char** environ;

namespace shardit::dist {

namespace {

volatile sig_atomic_t g_forward_signal = 0;

void remember_signal(int signal) { g_forward_signal = signal; }

// A port that was free a moment ago (the OS picks it); rank 0's store binds it right after.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "launch_local: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(ok, "launch_local: could not find a free port on 127.0.0.1: ", std::strerror(error));
  return ntohs(addr.sin_port);
}

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // our own stdout is gone; nothing useful to do
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

struct Stream {
  int fd = -1;       // read end of the rank's pipe, -1 once closed
  int out_fd = 1;    // where its lines go (1 or 2)
  std::string partial;
};

struct Rank {
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream out, err;
};

// Emits every complete line of `stream` with the prefix; at EOF (`flush`), the rest too.
void emit_lines(Stream& stream, const std::string& prefix, bool flush) {
  size_t start = 0;
  for (;;) {
    const size_t newline = stream.partial.find('\n', start);
    if (newline == std::string::npos) break;
    const std::string line = prefix + stream.partial.substr(start, newline - start + 1);
    write_all(stream.out_fd, line.data(), line.size());
    start = newline + 1;
  }
  stream.partial.erase(0, start);
  if (flush && !stream.partial.empty()) {
    const std::string line = prefix + stream.partial + "\n";
    write_all(stream.out_fd, line.data(), line.size());
    stream.partial.clear();
  }
}

std::string describe(int status) { return FailureNotice{0, status}.how(); }

// The mark of a failure notice's value, in its top bits (bits 25-30; the value stays positive).
constexpr int kNoticeMark = 0x2d;

bool failed(int status) { return WIFSIGNALED(status) || WEXITSTATUS(status) != 0; }

// The threads of this process (/proc/self/task), 0 when unknown.
int thread_count() {
  DIR* tasks = ::opendir("/proc/self/task");
  if (tasks == nullptr) return 0;
  int count = 0;
  while (const dirent* entry = ::readdir(tasks)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(tasks);
  return count;
}

// The environment of every rank ("NAME=value"): this process's, with the rendezvous variables.
// Built before any fork: between fork and exec only async-signal-safe calls are allowed.
std::vector<std::vector<std::string>> rank_environments(int nproc, int port) {
  std::map<std::string, std::string> base_env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string text = *entry;
    const auto eq = text.find('=');
    if (eq != std::string::npos) base_env[text.substr(0, eq)] = text.substr(eq + 1);
  }
  base_env["WORLD_SIZE"] = std::to_string(nproc);
  base_env["LOCAL_WORLD_SIZE"] = std::to_string(nproc);
  base_env["MASTER_ADDR"] = "127.0.0.1";
  base_env["MASTER_PORT"] = std::to_string(port);
  std::vector<std::vector<std::string>> env_strings(nproc);
  for (int r = 0; r < nproc; ++r) {
    auto env = base_env;
    env["RANK"] = std::to_string(r);
    env["LOCAL_RANK"] = std::to_string(r);
    for (const auto& [key, value] : env) env_strings[r].push_back(key + "=" + value);
  }
  return env_strings;
}

// SIGINT, SIGTERM and SIGHUP remembered (for the supervision loop to forward) while it lives; the
// previous handlers are restored after.
class ForwardedSignals {
 public:
  ForwardedSignals() {
    struct sigaction forward{};
    forward.sa_handler = remember_signal;
    sigemptyset(&forward.sa_mask);
    g_forward_signal = 0;
    ::sigaction(SIGINT, &forward, &old_int_);
    ::sigaction(SIGTERM, &forward, &old_term_);
    ::sigaction(SIGHUP, &forward, &old_hup_);
  }
  ~ForwardedSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGHUP, &old_hup_, nullptr);
  }
  ForwardedSignals(const ForwardedSignals&) = delete;
  ForwardedSignals& operator=(const ForwardedSignals&) = delete;

 private:
  struct sigaction old_int_{}, old_term_{}, old_hup_{};
};

// What starting the ranks gave: the ranks started (pid -1 for those that were not), and why the
// start stopped early ("" when every rank started).
struct StartedRanks {
  std::vector<Rank> ranks;
  std::string spawn_error;
  int interrupted_by = 0;  ///< the signal that stopped the start, 0 if none
};

// How every rank's process becomes the rank, settled before the first fork.
struct RankCommand {
  const std::vector<std::string>& argv;
  std::vector<char*> child_argv;  ///< argv for exec, null-terminated
  bool has_slash = false;         ///< argv[0] is a path (execve), else looked up on PATH (execvp)
  bool fork_only = false;         ///< run options.run_rank in the forked child instead of exec
  pid_t launcher_pid = 0;
};

// A rank's child side after fork: its own process group (so stopping a rank reaches the processes
// it started), death with the launcher, default signal handling, the pipes, then exec (or, with
// `fork_only`, the program's own entry point). Only async-signal-safe calls before exec.
[[noreturn]] void become_rank(RankCommand& command, std::vector<std::string>& env, std::vector<char*>& envp,
                              const LocalLaunchOptions& options, const int (&out_pipe)[2], const int (&err_pipe)[2]) {
  ::setpgid(0, 0);
  // Die with the launcher, also when it is SIGKILLed; if it died before this line, go now.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != command.launcher_pid) ::_exit(128 + SIGKILL);
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  ::signal(SIGHUP, SIG_DFL);
  if (options.prefix_output) {
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
  }
  if (command.fork_only) {
    ::clearenv();
    for (auto& entry : env) ::putenv(entry.data());
    int code = 1;
    try {
      code = options.run_rank(command.argv);
    } catch (...) {
      // run_rank reports its own errors; one that escapes still fails the rank.
    }
    std::fflush(stdout);
    std::fflush(stderr);
    std::exit(code);
  }
  if (command.has_slash) {
    ::execve(command.child_argv[0], command.child_argv.data(), envp.data());
  } else {
    environ = envp.data();
    ::execvp(command.child_argv[0], command.child_argv.data());
  }
  const char message[] = "shardit: could not execute the rank's command\n";
  (void)!::write(2, message, sizeof(message) - 1);
  ::_exit(127);
}

// Starts the ranks one by one (fork+exec, fork alone, or the caller's spawn), each with its
// output pipes when prefixed; a forwarded signal or a failed start stops the starting.
StartedRanks start_ranks(std::vector<std::string>& argv, std::vector<std::vector<std::string>>& env_strings,
                         const LocalLaunchOptions& options) {
  const int nproc = options.nproc;
  std::vector<char*> child_argv;
  for (auto& arg : argv) child_argv.push_back(arg.data());
  child_argv.push_back(nullptr);
  // Fork without exec only from a process with no other thread: a child of a threaded process
  // may only make async-signal-safe calls.
  const bool fork_only = options.run_rank && !options.spawn && thread_count() == 1;
  RankCommand command{argv, std::move(child_argv), argv[0].find('/') != std::string::npos, fork_only, ::getpid()};

  std::fflush(stdout);
  std::fflush(stderr);
  StartedRanks started;
  started.ranks.resize(nproc);
  std::string& spawn_error = started.spawn_error;
  for (int r = 0; r < nproc && spawn_error.empty(); ++r) {
    if (g_forward_signal != 0) {
      started.interrupted_by = g_forward_signal;
      // Stop starting ranks; the supervision forwards the signal to those already running.
      spawn_error = std::string("interrupted by ") + strsignal(g_forward_signal) + " after starting " +
                    std::to_string(r) + " of " + std::to_string(nproc) + " ranks";
      break;
    }
    int out_pipe[2] = {-1, -1};
    int err_pipe[2] = {-1, -1};
    const auto close_pipes = [&] {
      for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) {
        if (fd >= 0) ::close(fd);
      }
    };
    if (options.prefix_output &&
        (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)) {
      spawn_error = std::string("pipe() failed: ") + std::strerror(errno);
      close_pipes();
      break;
    }
    std::vector<char*> envp;
    for (auto& entry : env_strings[r]) envp.push_back(entry.data());
    envp.push_back(nullptr);

    pid_t pid = -1;
    if (options.spawn) {
      pid = options.spawn(argv, env_strings[r], options.prefix_output ? out_pipe[1] : -1,
                          options.prefix_output ? err_pipe[1] : -1, spawn_error);
      if (pid < 0) {
        if (spawn_error.empty()) spawn_error = "the rank's spawn function failed";
        close_pipes();
        break;
      }
    } else {
      pid = ::fork();
    }
    if (pid == 0) become_rank(command, env_strings[r], envp, options, out_pipe, err_pipe);
    if (pid < 0) {  // fork() failed
      spawn_error = std::string("fork() failed: ") + std::strerror(errno);
      close_pipes();
      break;
    }
    ::setpgid(pid, pid);  // also here, so signals sent before the child's own call reach it
    Rank& rank = started.ranks[r];
    rank.pid = pid;
    rank.running = true;
    if (options.prefix_output) {
      ::close(out_pipe[1]);
      ::close(err_pipe[1]);
      rank.out = Stream{out_pipe[0], 1, {}};
      rank.err = Stream{err_pipe[0], 2, {}};
    }
  }
  return started;
}

// Watches the started ranks until every one has exited and its output is drained: the first
// failure stops the others (SIGTERM, then SIGKILL after the grace period), forwarded signals reach
// every rank (a second one kills them), and every output line goes out with its rank's prefix.
class Supervisor {
 public:
  Supervisor(std::vector<Rank>& ranks, const LocalLaunchOptions& options, const std::string& spawn_error)
      : ranks_(ranks), options_(options), stopping_(!spawn_error.empty()) {
    if (stopping_) {
      const std::string line = "shardit: launching the ranks failed: " + spawn_error + "\n";
      write_all(2, line.data(), line.size());
      signal_running(SIGTERM);
    }
  }

  void run() {
    for (;;) {
      const bool any_running = reap();
      forward_signal(any_running);
      if (stopping_ && !stop_asked_ && !killed_ && any_running &&
          Clock::now() - stop_since_ > std::chrono::seconds(options_.grace_seconds)) {
        signal_running(SIGKILL);
        killed_ = true;
      }
      if (!pump_output(any_running)) break;
    }
  }

  /// The first rank that failed on its own (not after being told to stop), -1 if none.
  int failed_rank() const { return failed_rank_; }
  int failed_status() const { return failed_status_; }

 private:
  using Clock = std::chrono::steady_clock;

  void signal_running(int sig) {
    for (auto& rank : ranks_) {
      if (!rank.running) continue;
      if (::kill(-rank.pid, sig) != 0) ::kill(rank.pid, sig);
    }
  }

  // SIGTERM to the running ranks because rank `failed` ended with `status`: to each rank's own
  // process first as a failure notice (FailureNotice), then to its process group (what the rank
  // started); the second SIGTERM merges with the first while it is pending.
  void stop_after_failure(int failed, int status) {
    sigval value{};
    value.sival_int = encode_failure_notice(FailureNotice{failed, status});
    for (auto& rank : ranks_) {
      if (rank.running) ::sigqueue(rank.pid, SIGTERM, value);
    }
    signal_running(SIGTERM);
  }

  // Reaps whatever exited; the first failure stops the others. Whether any rank still runs.
  bool reap() {
    bool any_running = false;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      Rank& rank = ranks_[r];
      if (!rank.running) continue;
      int status = 0;
      const pid_t done = ::waitpid(rank.pid, &status, WNOHANG);
      if (done != rank.pid) {
        any_running = true;
        continue;
      }
      rank.running = false;
      rank.status = status;
      if (failed(status) && failed_rank_ < 0 && !stopping_) {
        failed_rank_ = r;
        failed_status_ = status;
        const std::string line =
            "shardit: rank " + std::to_string(r) + " failed (" + describe(status) + "); stopping the other ranks\n";
        write_all(2, line.data(), line.size());
        stopping_ = true;
        stop_since_ = Clock::now();
        stop_after_failure(r, status);
      }
    }
    return any_running;
  }

  // Stopping because the user asked (a forwarded signal): the ranks take the time they need to
  // finish (a server answers its running request), and a second signal kills them at once.
  void forward_signal(bool any_running) {
    if (g_forward_signal == 0) return;
    const int sig = g_forward_signal;
    g_forward_signal = 0;
    if (stop_asked_ && !killed_ && any_running) {
      const std::string line = "shardit: a second signal: killing the ranks\n";
      write_all(2, line.data(), line.size());
      signal_running(SIGKILL);
      killed_ = true;
    } else {
      signal_running(sig);
    }
    if (!stopping_) {
      stopping_ = true;
      stop_asked_ = true;
      stop_since_ = Clock::now();
    }
  }

  // Copies what the ranks wrote, line by line with their prefix. False once there is nothing more
  // to wait for.
  bool pump_output(bool any_running) {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    std::vector<int> stream_ranks;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      for (Stream* stream : {&ranks_[r].out, &ranks_[r].err}) {
        if (stream->fd < 0) continue;
        fds.push_back(pollfd{stream->fd, POLLIN, 0});
        streams.push_back(stream);
        stream_ranks.push_back(r);
      }
    }
    if (!any_running && fds.empty()) return false;
    if (fds.empty()) {
      ::usleep(20000);
      return true;
    }
    // Once every rank has exited, only drain what is already written: a process a rank left
    // behind may hold its pipe open indefinitely.
    const int ready = ::poll(fds.data(), fds.size(), any_running ? 50 : 0);
    if (ready == 0 && !any_running) {
      for (size_t i = 0; i < fds.size(); ++i) {
        emit_lines(*streams[i], "[" + std::to_string(stream_ranks[i]) + "] ", true);
        ::close(streams[i]->fd);
        streams[i]->fd = -1;
      }
      return false;
    }
    if (ready <= 0) return true;  // timeout or EINTR (a signal to forward)
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Stream& stream = *streams[i];
      const std::string prefix = "[" + std::to_string(stream_ranks[i]) + "] ";
      char buffer[65536];
      const ssize_t n = ::read(stream.fd, buffer, sizeof(buffer));
      if (n > 0) {
        stream.partial.append(buffer, static_cast<size_t>(n));
        emit_lines(stream, prefix, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit_lines(stream, prefix, true);
        ::close(stream.fd);
        stream.fd = -1;
      }
    }
    return true;
  }

  std::vector<Rank>& ranks_;
  const LocalLaunchOptions& options_;
  int failed_rank_ = -1;
  int failed_status_ = 0;
  bool stopping_ = false;
  bool stop_asked_ = false;
  bool killed_ = false;
  Clock::time_point stop_since_ = Clock::now();
};

// The launcher's exit code: the signal that stopped the start, 1 for a failed start, the first
// failed rank's, or (stopped by a forwarded signal) the first failure among the ranks.
int launch_exit_code(const StartedRanks& started, const Supervisor& supervisor) {
  if (started.interrupted_by != 0) return 128 + started.interrupted_by;
  if (!started.spawn_error.empty()) return 1;
  if (supervisor.failed_rank() >= 0) {
    const int status = supervisor.failed_status();
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return WEXITSTATUS(status);
  }
  for (const auto& rank : started.ranks) {
    if (failed(rank.status)) return WIFSIGNALED(rank.status) ? 128 + WTERMSIG(rank.status) : WEXITSTATUS(rank.status);
  }
  return 0;
}

}  // namespace

std::string FailureNotice::how() const {
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exit code " + std::to_string(WEXITSTATUS(wait_status));
}

// Bits 0-15: the rank; 16-23: the exit code or signal; 24: killed by a signal; 25-30: the mark.
int encode_failure_notice(const FailureNotice& notice) {
  const bool signalled = WIFSIGNALED(notice.wait_status);
  const int code = (signalled ? WTERMSIG(notice.wait_status) : WEXITSTATUS(notice.wait_status)) & 0xff;
  return (kNoticeMark << 25) | (signalled ? 1 << 24 : 0) | (code << 16) | (notice.rank & 0xffff);
}

bool is_failure_notice(const siginfo_t* info) {
  return info != nullptr && info->si_code == SI_QUEUE && info->si_pid == ::getppid() &&
         ((info->si_value.sival_int >> 25) & 0x3f) == kNoticeMark;
}

FailureNotice decode_failure_notice(int value) {
  const int code = (value >> 16) & 0xff;
  // A wait status as waitpid would give it: the signal in the low bits, or the code shifted.
  const int status = (value & (1 << 24)) != 0 ? code : code << 8;
  return FailureNotice{value & 0xffff, status};
}

std::string current_executable() {
  std::vector<char> buffer(4096);
  const ssize_t n = ::readlink("/proc/self/exe", buffer.data(), buffer.size() - 1);
  TORCH_CHECK(n > 0, "could not read /proc/self/exe: ", std::strerror(errno));
  return std::string(buffer.data(), static_cast<size_t>(n));
}

int launch_local(const std::vector<std::string>& argv_in, const LocalLaunchOptions& options) {
  TORCH_CHECK(options.nproc >= 1 && options.nproc <= kMaxLocalRanks, "--nproc-per-node ", options.nproc,
              " is out of range: the local launcher starts 1 to ", kMaxLocalRanks, " ranks");
  TORCH_CHECK(!argv_in.empty(), "launch_local: no command to run");
  std::vector<std::string> argv = argv_in;
  if (argv[0].empty()) argv[0] = current_executable();
  std::vector<std::vector<std::string>> env_strings = rank_environments(options.nproc, free_port());

  const ForwardedSignals signals;
  StartedRanks started = start_ranks(argv, env_strings, options);
  Supervisor supervisor(started.ranks, options, started.spawn_error);
  supervisor.run();
  return launch_exit_code(started, supervisor);
}

}  // namespace shardit::dist
