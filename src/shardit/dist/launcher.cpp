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

std::string describe(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exit code " + std::to_string(WEXITSTATUS(status));
}

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

}  // namespace

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
  const int nproc = options.nproc;
  const int port = free_port();

  // Everything the children need is built before fork: between fork and exec only
  // async-signal-safe calls are allowed.
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
  std::vector<char*> child_argv;
  for (auto& arg : argv) child_argv.push_back(arg.data());
  child_argv.push_back(nullptr);
  const bool has_slash = argv[0].find('/') != std::string::npos;

  struct sigaction forward{}, old_int{}, old_term{}, old_hup{};
  forward.sa_handler = remember_signal;
  sigemptyset(&forward.sa_mask);
  g_forward_signal = 0;
  ::sigaction(SIGINT, &forward, &old_int);
  ::sigaction(SIGTERM, &forward, &old_term);
  ::sigaction(SIGHUP, &forward, &old_hup);
  const pid_t launcher_pid = ::getpid();
  // Fork without exec only from a process with no other thread: a child of a threaded process
  // may only make async-signal-safe calls.
  const bool fork_only = options.run_rank && !options.spawn && thread_count() == 1;

  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<Rank> ranks(nproc);
  std::string spawn_error;
  int interrupted_by = 0;
  for (int r = 0; r < nproc && spawn_error.empty(); ++r) {
    if (g_forward_signal != 0) {
      interrupted_by = g_forward_signal;
      // Stop starting ranks; the loop below forwards the signal to those already running.
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
    if (pid == 0) {
      // Child: its own process group (so stopping a rank reaches the processes it started),
      // default signal handling, the pipes, exec.
      ::setpgid(0, 0);
      // Die with the launcher, also when it is SIGKILLed; if it died before this line, go now.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher_pid) ::_exit(128 + SIGKILL);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGHUP, SIG_DFL);
      if (options.prefix_output) {
        ::dup2(out_pipe[1], 1);
        ::dup2(err_pipe[1], 2);
      }
      if (fork_only) {
        ::clearenv();
        for (auto& entry : env_strings[r]) ::putenv(entry.data());
        int code = 1;
        try {
          code = options.run_rank(argv);
        } catch (...) {
          // run_rank reports its own errors; one that escapes still fails the rank.
        }
        std::fflush(stdout);
        std::fflush(stderr);
        std::exit(code);
      }
      if (has_slash) {
        ::execve(child_argv[0], child_argv.data(), envp.data());
      } else {
        environ = envp.data();
        ::execvp(child_argv[0], child_argv.data());
      }
      const char message[] = "shardit: could not execute the rank's command\n";
      (void)!::write(2, message, sizeof(message) - 1);
      ::_exit(127);
    }
    if (pid < 0) {  // fork() failed
      spawn_error = std::string("fork() failed: ") + std::strerror(errno);
      close_pipes();
      break;
    }
    ::setpgid(pid, pid);  // also here, so signals sent before the child's own call reach it
    ranks[r].pid = pid;
    ranks[r].running = true;
    if (options.prefix_output) {
      ::close(out_pipe[1]);
      ::close(err_pipe[1]);
      ranks[r].out = Stream{out_pipe[0], 1, {}};
      ranks[r].err = Stream{err_pipe[0], 2, {}};
    }
  }

  using Clock = std::chrono::steady_clock;
  int failed_rank = -1;
  int failed_status = 0;
  bool stopping = !spawn_error.empty();
  // Stopping because the user asked (a forwarded signal): the ranks take the time they need to
  // finish (a server answers its running request), and a second signal kills them at once.
  bool stop_asked = false;
  bool killed = false;
  Clock::time_point stop_since = Clock::now();
  if (stopping) {
    const std::string line = "shardit: launching the ranks failed: " + spawn_error + "\n";
    write_all(2, line.data(), line.size());
  }
  auto signal_running = [&](int sig) {
    for (auto& rank : ranks) {
      if (!rank.running) continue;
      if (::kill(-rank.pid, sig) != 0) ::kill(rank.pid, sig);
    }
  };
  if (stopping) signal_running(SIGTERM);

  for (;;) {
    // Reap whatever exited.
    bool any_running = false;
    for (int r = 0; r < nproc; ++r) {
      Rank& rank = ranks[r];
      if (!rank.running) continue;
      int status = 0;
      const pid_t done = ::waitpid(rank.pid, &status, WNOHANG);
      if (done == rank.pid) {
        rank.running = false;
        rank.status = status;
        if (failed(status) && failed_rank < 0 && !stopping) {
          failed_rank = r;
          failed_status = status;
          const std::string line = "shardit: rank " + std::to_string(r) + " failed (" +
                                   describe(status) + "); stopping the other ranks\n";
          write_all(2, line.data(), line.size());
          stopping = true;
          stop_since = Clock::now();
          signal_running(SIGTERM);
        }
      } else {
        any_running = true;
      }
    }
    if (g_forward_signal != 0) {
      const int sig = g_forward_signal;
      g_forward_signal = 0;
      if (stop_asked && !killed && any_running) {
        const std::string line = "shardit: a second signal: killing the ranks\n";
        write_all(2, line.data(), line.size());
        signal_running(SIGKILL);
        killed = true;
      } else {
        signal_running(sig);
      }
      if (!stopping) {
        stopping = true;
        stop_asked = true;
        stop_since = Clock::now();
      }
    }
    if (stopping && !stop_asked && !killed && any_running &&
        Clock::now() - stop_since > std::chrono::seconds(options.grace_seconds)) {
      signal_running(SIGKILL);
      killed = true;
    }

    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    std::vector<int> stream_ranks;
    for (int r = 0; r < nproc; ++r) {
      for (Stream* stream : {&ranks[r].out, &ranks[r].err}) {
        if (stream->fd < 0) continue;
        fds.push_back(pollfd{stream->fd, POLLIN, 0});
        streams.push_back(stream);
        stream_ranks.push_back(r);
      }
    }
    if (!any_running && fds.empty()) break;
    if (fds.empty()) {
      ::usleep(20000);
      continue;
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
      break;
    }
    if (ready <= 0) continue;  // timeout or EINTR (a signal to forward)
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
  }

  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  ::sigaction(SIGHUP, &old_hup, nullptr);

  if (interrupted_by != 0) return 128 + interrupted_by;
  if (!spawn_error.empty()) return 1;
  if (failed_rank >= 0) {
    if (WIFSIGNALED(failed_status)) return 128 + WTERMSIG(failed_status);
    return WEXITSTATUS(failed_status);
  }
  // Stopped by a forwarded signal, or every rank failed only after being told to stop.
  for (const auto& rank : ranks) {
    if (failed(rank.status)) return WIFSIGNALED(rank.status) ? 128 + WTERMSIG(rank.status) : WEXITSTATUS(rank.status);
  }
  return 0;
}

}  // namespace shardit::dist
