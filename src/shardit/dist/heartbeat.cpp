#include "shardit/dist/heartbeat.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <exception>
#include <fstream>
#include <iterator>

#include "shardit/dist/rank_list.h"

namespace shardit::dist {

namespace {

// How often each rank bumps its heartbeat counter in the store, and how long a failed collective
// watches the counters before it calls a rank lost.
constexpr auto kHeartbeatPeriod = std::chrono::milliseconds(200);
constexpr auto kProbeWindow = std::chrono::milliseconds(1000);

std::string heartbeat_key(int rank) { return "shardit/heartbeat/" + std::to_string(rank); }
// "<host> <pid>" of a rank, so that a rank on the same host can tell a stopped process from a gone one.
std::string process_key(int rank) { return "shardit/process/" + std::to_string(rank); }

std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

// What became of a process of this host whose heartbeat stands still, from /proc/<pid>/stat's
// state: stopped (SIGSTOP, a debugger), gone (no process, or a zombie), or alive but silent.
enum class ProcessState { Gone, Stopped, Silent };
ProcessState process_state(int64_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos || paren + 2 >= stat.size()) return ProcessState::Gone;
  const char state = stat[paren + 2];
  if (state == 'T' || state == 't') return ProcessState::Stopped;
  if (state == 'Z' || state == 'X' || state == 'x') return ProcessState::Gone;
  return ProcessState::Silent;
}

// How a rank whose heartbeat stands still is doing, when it runs on this host (known from the
// host and pid it published); Gone otherwise (no process to look at).
ProcessState local_state(c10d::Store& store, std::mutex& store_mutex, int rank) {
  try {
    std::lock_guard<std::mutex> store_lock(store_mutex);
    if (!store.check({process_key(rank)})) return ProcessState::Gone;
    const std::vector<uint8_t> value = store.get(process_key(rank));
    const std::string text(value.begin(), value.end());
    const size_t space = text.rfind(' ');
    if (space == std::string::npos || text.substr(0, space) != host_name()) return ProcessState::Gone;
    return process_state(std::stoll(text.substr(space + 1)));
  } catch (const std::exception&) {
    return ProcessState::Gone;
  }
}

}  // namespace

std::unique_ptr<Heartbeat> Heartbeat::start(const std::string& host, int port, int rank,
                                            std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5));
  auto store = c10::make_intrusive<c10d::TCPStore>(host, options);
  return std::make_unique<Heartbeat>(store, rank);
}

Heartbeat::Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank)
    : store_(std::move(store)), rank_(rank), thread_([this] { run(); }) {}

Heartbeat::~Heartbeat() { stop(); }

void Heartbeat::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::string Heartbeat::lost_ranks(const std::vector<int>& global_ranks, const std::string& when_alive) {
  std::vector<int> others;
  for (int r : global_ranks) {
    if (r != rank_) others.push_back(r);
  }
  if (others.empty()) return when_alive;
  try {
    std::vector<int64_t> before = read(others);
    std::this_thread::sleep_for(kProbeWindow);
    std::vector<int64_t> after = read(others);
    std::vector<int> lost, stopped, silent, never_joined;
    for (size_t i = 0; i < others.size(); ++i) {
      if (after[i] == 0) {
        never_joined.push_back(others[i]);
      } else if (after[i] == before[i]) {
        switch (local_state(*store_, store_mutex_, others[i])) {
          case ProcessState::Stopped: stopped.push_back(others[i]); break;
          case ProcessState::Silent: silent.push_back(others[i]); break;
          case ProcessState::Gone: lost.push_back(others[i]); break;
        }
      }
    }
    std::string text;
    const auto add = [&text](const std::vector<int>& ranks, const std::string& what) {
      if (ranks.empty()) return;
      text += (text.empty() ? "" : "; ") + std::string(ranks.size() == 1 ? "lost rank " : "lost ranks ") +
              list_ranks(ranks) + " (" + what + ")";
    };
    add(lost, "exited, crashed or was killed");
    add(stopped, "its process is stopped, by SIGSTOP or a debugger; SIGCONT resumes it");
    add(silent, "its process is alive but stopped answering");
    if (!never_joined.empty()) {
      text += (text.empty() ? "" : "; ") + std::string(never_joined.size() == 1 ? "rank " : "ranks ") +
              list_ranks(never_joined) + " never joined";
    }
    return text.empty() ? when_alive : text;
  } catch (const std::exception& e) {
    return "the rendezvous store hosted by rank 0 is unreachable: rank 0 exited (perhaps after "
           "another rank failed), crashed or was killed";
  }
}

std::vector<int64_t> Heartbeat::read(const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> lock(store_mutex_);
  std::vector<int64_t> values;
  for (int r : ranks) values.push_back(store_->add(heartbeat_key(r), 0));
  return values;
}

void Heartbeat::run() {
  try {
    const std::string me = host_name() + " " + std::to_string(::getpid());
    std::lock_guard<std::mutex> store_lock(store_mutex_);
    store_->set(process_key(rank_), std::vector<uint8_t>(me.begin(), me.end()));
  } catch (const std::exception&) {
    return;  // the store is gone (rank 0 exited): nothing left to report to
  }
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    lock.unlock();
    try {
      std::lock_guard<std::mutex> store_lock(store_mutex_);
      store_->add(heartbeat_key(rank_), 1);
    } catch (const std::exception&) {
      return;  // the store is gone (rank 0 exited): nothing left to report to
    }
    lock.lock();
    wake_.wait_for(lock, kHeartbeatPeriod, [this] { return stopping_; });
  }
}

}  // namespace shardit::dist
