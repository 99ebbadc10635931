#include "support/multiprocess.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
// run_on_ranks' folder, the one thing it passes to the ranks (RankContext::dir).
constexpr const char* kSharedDirVariable = "SHARDIT_TEST_SHARED_DIR";

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

// The rank forker (start_rank_forker): a socket to it in the test process, -1 when there is none.
int g_forker_socket = -1;

// A request to the forker, one SOCK_SEQPACKET message: this header, then argc + envc strings each
// ended by '\0'; the rank's stdout and stderr descriptors travel beside it (SCM_RIGHTS) when
// `with_fds`. The answer is one pid_t: the rank's pid, or -errno.
struct ForkRequestHeader {
  pid_t launcher = 0;
  uint32_t with_fds = 0;
  uint32_t argc = 0;
  uint32_t envc = 0;
};
constexpr size_t kMaxForkRequest = 1 << 20;  // a command line and an environment, with room

struct ForkRequest {
  ForkRequestHeader header;
  std::vector<std::string> argv, env;
  int out_fd = -1, err_fd = -1;
};

ssize_t send_retrying(int socket, msghdr* message) {
  for (;;) {
    const ssize_t n = ::sendmsg(socket, message, MSG_NOSIGNAL);
    if (n >= 0 || errno != EINTR) return n;
  }
}

ssize_t receive_retrying(int socket, msghdr* message) {
  for (;;) {
    const ssize_t n = ::recvmsg(socket, message, MSG_CMSG_CLOEXEC);
    if (n >= 0 || errno != EINTR) return n;
  }
}

// Reads one request; false when the test process is gone (end of stream) or it is malformed.
bool receive_fork_request(int socket, std::vector<char>& buffer, ForkRequest& request) {
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
  iovec io{buffer.data(), buffer.size()};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  const ssize_t n = receive_retrying(socket, &message);
  if (n < static_cast<ssize_t>(sizeof(ForkRequestHeader))) return false;
  std::memcpy(&request.header, buffer.data(), sizeof(ForkRequestHeader));
  request.out_fd = request.err_fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&message); c != nullptr; c = CMSG_NXTHDR(&message, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(2 * sizeof(int))) {
      int fds[2];
      std::memcpy(fds, CMSG_DATA(c), sizeof(fds));
      request.out_fd = fds[0];
      request.err_fd = fds[1];
    }
  }
  request.argv.clear();
  request.env.clear();
  const char* cursor = buffer.data() + sizeof(ForkRequestHeader);
  const char* end = buffer.data() + n;
  for (uint32_t i = 0; i < request.header.argc + request.header.envc; ++i) {
    const void* nul = std::memchr(cursor, '\0', static_cast<size_t>(end - cursor));
    if (nul == nullptr) return false;
    (i < request.header.argc ? request.argv : request.env).emplace_back(cursor);
    cursor = static_cast<const char*>(nul) + 1;
  }
  return !request.argv.empty() && (request.header.with_fds == 0 || request.out_fd >= 0);
}

// In a freshly forked rank: waits until it belongs to the test process (the subreaper it is
// handed to when the intermediate process exits), dies with it from then on, and takes the
// request's process group, signals, environment, output and command line.
void become_rank(const ForkRequest& request, int& argc, char**& argv) {
  for (int waited_ms = 0; ::getppid() != request.header.launcher; ++waited_ms) {
    if (waited_ms > 10000) ::_exit(127);  // the test process is gone
    ::usleep(1000);
  }
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != request.header.launcher) ::_exit(128 + SIGKILL);
  ::setpgid(0, 0);
  // As the launcher's exec path: these to their defaults (the forker ignores SIGINT), the rest as
  // the test process had them when it started.
  for (int signal : {SIGINT, SIGTERM, SIGHUP}) ::signal(signal, SIG_DFL);
  ::clearenv();
  for (const std::string& entry : request.env) ::putenv(::strdup(entry.c_str()));
  if (request.header.with_fds != 0) {
    ::dup2(request.out_fd, 1);
    ::dup2(request.err_fd, 2);
    ::close(request.out_fd);
    ::close(request.err_fd);
  }
  argc = static_cast<int>(request.argv.size());
  argv = new char*[request.argv.size() + 1];
  for (size_t i = 0; i < request.argv.size(); ++i) argv[i] = ::strdup(request.argv[i].c_str());
  argv[request.argv.size()] = nullptr;
}

// The forker's loop. Each rank is forked through an intermediate process that exits at once, so
// the rank is handed to the test process (a child subreaper) and the launcher there waits for it,
// signals it and reaps it as its own child. Returns only in a forked rank.
void serve_fork_requests(int socket, pid_t test_process, int& argc, char**& argv) {
  std::vector<char> buffer(kMaxForkRequest);
  ForkRequest request;
  for (;;) {
    if (!receive_fork_request(socket, buffer, request)) ::_exit(0);
    pid_t rank = -errno;
    int pid_pipe[2];
    if (::pipe2(pid_pipe, O_CLOEXEC) == 0) {
      const pid_t intermediate = ::fork();
      if (intermediate == 0) {
        const pid_t forked = ::fork();
        if (forked == 0) {
          ::close(socket);
          ::close(pid_pipe[0]);
          ::close(pid_pipe[1]);
          become_rank(request, argc, argv);
          return;
        }
        const pid_t answer = forked > 0 ? forked : -errno;
        (void)!::write(pid_pipe[1], &answer, sizeof(answer));
        ::_exit(0);
      }
      ::close(pid_pipe[1]);
      if (intermediate < 0) {
        rank = -errno;
      } else {
        if (::read(pid_pipe[0], &rank, sizeof(rank)) != static_cast<ssize_t>(sizeof(rank))) rank = -ECHILD;
        while (::waitpid(intermediate, nullptr, 0) < 0 && errno == EINTR) {
        }
      }
      ::close(pid_pipe[0]);
    }
    if (request.out_fd >= 0) ::close(request.out_fd);
    if (request.err_fd >= 0) ::close(request.err_fd);
    if (::send(socket, &rank, sizeof(rank), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(rank))) ::_exit(0);
    if (::getppid() != test_process) ::_exit(0);
  }
}

// run_ranks' way to start a rank: ask the forker. -1 with `error` set when it cannot.
pid_t fork_rank(const std::vector<std::string>& argv, const std::vector<std::string>& env, int out_fd, int err_fd,
                std::string& error) {
  std::string payload(sizeof(ForkRequestHeader), '\0');
  ForkRequestHeader header;
  header.launcher = ::getpid();
  header.with_fds = out_fd >= 0 && err_fd >= 0 ? 1 : 0;
  header.argc = static_cast<uint32_t>(argv.size());
  header.envc = static_cast<uint32_t>(env.size());
  std::memcpy(payload.data(), &header, sizeof(header));
  for (const auto* strings : {&argv, &env}) {
    for (const std::string& text : *strings) payload.append(text.c_str(), text.size() + 1);
  }
  if (payload.size() > kMaxForkRequest) {
    error = "the rank's command line and environment are " + std::to_string(payload.size()) +
            " bytes, more than the rank forker takes (" + std::to_string(kMaxForkRequest) + ")";
    return -1;
  }
  iovec io{payload.data(), payload.size()};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  if (header.with_fds != 0) {
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&message);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(2 * sizeof(int));
    const int fds[2] = {out_fd, err_fd};
    std::memcpy(CMSG_DATA(c), fds, sizeof(fds));
  }
  pid_t answer = 0;
  if (send_retrying(g_forker_socket, &message) != static_cast<ssize_t>(payload.size())) {
    error = std::string("could not reach the rank forker: ") + std::strerror(errno);
    return -1;
  }
  ssize_t n = 0;
  do {
    n = ::recv(g_forker_socket, &answer, sizeof(answer), 0);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof(answer))) {
    error = "the rank forker did not answer (it exited)";
    return -1;
  }
  if (answer < 0) {
    error = std::string("the rank forker could not fork: ") + std::strerror(static_cast<int>(-answer));
    return -1;
  }
  return answer;
}

std::vector<std::string> lines_of(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

void start_rank_forker(int& argc, char**& argv) {
  if (is_worker() || env_or("SHARDIT_TEST_EXEC_RANKS") == "1") return;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--gtest_list_tests") return;  // starts no ranks
  }
  int sockets[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sockets) != 0) return;  // run_ranks executes
  // The ranks are handed to this process when their intermediate parent exits.
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    ::close(sockets[0]);
    ::close(sockets[1]);
    return;
  }
  const pid_t test_process = ::getpid();
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t forker = ::fork();
  if (forker == 0) {
    ::close(sockets[0]);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != test_process) ::_exit(0);
    // Ctrl-C reaches the whole foreground group: the test process decides, the forker follows it.
    ::signal(SIGINT, SIG_IGN);
    serve_fork_requests(sockets[1], test_process, argc, argv);
    return;  // in a forked rank
  }
  ::close(sockets[1]);
  if (forker < 0) {
    ::close(sockets[0]);
    return;
  }
  g_forker_socket = sockets[0];
}

void record_worker_tests() {
  const std::string dir = env_or(kRecordDirVariable);
  if (is_worker() && !dir.empty()) {
    ::testing::UnitTest::GetInstance()->listeners().Append(
        new WorkerRecorder(dir + "/" + std::to_string(::getpid())));
  }
}

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

int run_ranks(int nproc, std::map<std::string, std::string> extra_env, int grace_seconds) {
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
  if (grace_seconds > 0) options.grace_seconds = grace_seconds;
  if (g_forker_socket >= 0) options.spawn = fork_rank;
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

RanksRun run_on_ranks(int nproc, const std::function<void(const RankContext&)>& on_rank, int grace_seconds) {
  if (is_worker()) {
    on_rank(RankContext{env_or(kSharedDirVariable)});
    std::fflush(stdout);
    std::fflush(stderr);
    std::exit(::testing::Test::HasFailure() ? 1 : 0);
  }
  RanksRun run;
  run.dir = make_temp_dir("ranks");
  run.exit_code = run_ranks(nproc, {{kSharedDirVariable, run.dir}}, grace_seconds);
  return run;
}

}  // namespace shardit::testing
