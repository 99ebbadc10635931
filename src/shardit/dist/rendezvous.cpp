// The rendezvous: rank 0 hosts c10d's TCPStore, every rank announces itself there and waits for
// the others, and later checks compare one value of every rank through it.
#include "shardit/dist/rendezvous.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "shardit/core/error.h"
#include "shardit/dist/rank_list.h"

namespace shardit::dist {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollPeriod = std::chrono::milliseconds(50);

long elapsed_ms(Clock::time_point since) {
  return static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - since).count());
}

std::string as_text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> as_bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

// A failed agreement, saying which rank saw it and when.
[[noreturn]] void fail_agreement(int rank, const std::string& cause, Clock::time_point start,
                                 std::chrono::milliseconds timeout) {
  TORCH_CHECK(false, "rank ", rank, ": ", cause, " (after ", elapsed_ms(start), " ms; timeout ", timeout.count(),
              " ms)");
}

// "rank 3" or "ranks 3, 5": the ranks a rendezvous step still waits for.
std::string missing_ranks(const std::vector<int>& missing) {
  return (missing.size() == 1 ? "rank " : "ranks ") + list_ranks(missing);
}

// Waits until something accepts connections at host:port (true), or until `deadline` (false). A
// client that finds no listener yet (rank 0 still starting its store) is retried by c10d only
// after a whole second, which ranks started together would nearly always pay. An address that
// does not resolve is left to the store's own connection, which names it (true).
bool wait_for_listener(const std::string& host, int port, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr) return true;
  for (;;) {
    for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) continue;
      bool connected = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
      if (!connected && errno == EINPROGRESS) {
        pollfd pending{fd, POLLOUT, 0};
        int error = 0;
        socklen_t length = sizeof(error);
        connected = ::poll(&pending, 1, 200) == 1 &&
                    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
      }
      ::close(fd);
      if (connected) {
        ::freeaddrinfo(found);
        return true;
      }
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::freeaddrinfo(found);
  return false;
}

// Every rank writes `value` under `prefix` + its rank and waits until all `world_size` ranks have
// written theirs. `compare` is called for each other rank's value as soon as it is there, so a
// disagreement is reported at once rather than at the deadline. Returns the ranks that had not
// written theirs by `deadline` (none when all had).
std::vector<int> exchange(c10d::Store& store, const std::string& prefix, int rank, int world_size,
                          const std::string& value, Clock::time_point deadline,
                          const std::function<void(int, const std::string&)>& compare) {
  store.set(prefix + std::to_string(rank), as_bytes(value));
  std::vector<bool> seen(world_size, false);
  seen[rank] = true;
  int remaining = world_size - 1;
  for (;;) {
    for (int r = 0; r < world_size; ++r) {
      // A sweep over a huge world (one store call per rank) stops at the deadline, so the error
      // comes in time (a missed key is reported missing, never compared late).
      if (r % 256 == 255 && Clock::now() >= deadline) break;
      const std::string key = prefix + std::to_string(r);
      if (seen[r] || !store.check({key})) continue;
      seen[r] = true;
      --remaining;
      compare(r, as_text(store.get(key)));
    }
    if (remaining == 0) return {};
    if (Clock::now() >= deadline) {
      std::vector<int> missing;
      for (int r = 0; r < world_size; ++r) {
        if (!seen[r]) missing.push_back(r);
      }
      return missing;
    }
    std::this_thread::sleep_for(kPollPeriod);
  }
}

// A window of `text` around byte `at`, for showing where two values differ.
std::string window(const std::string& text, size_t at) {
  const size_t begin = at > 40 ? at - 40 : 0;
  std::string out = text.substr(begin, 100);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  }
  return (begin > 0 ? "..." : "") + out + (begin + 100 < text.size() ? "..." : "");
}

}  // namespace

std::string store_host(const LaunchEnv& env) { return env.master_addr.empty() ? "127.0.0.1" : env.master_addr; }

std::string store_address(const LaunchEnv& env) { return store_host(env) + ":" + std::to_string(env.master_port); }

void check_port_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;  // the store's own bind will report it
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(bound || error != EADDRINUSE, "rank 0 cannot host the rendezvous store: MASTER_PORT=", port,
              " is already in use on this host (another job or program listens there); choose a free MASTER_PORT, "
              "or let `shardit --nproc-per-node N` pick one");
}

c10::intrusive_ptr<c10d::Store> join_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  const std::string host = store_host(env);
  const auto start = Clock::now();
  TORCH_CHECK(env.rank == 0 || wait_for_listener(host, env.master_port, start + timeout),
              "nothing listens there (rank 0 hosts the store)");
  // Rank 0 hosts the store (c10d's server listens on every interface of its host); everyone
  // connects to MASTER_ADDR, or loopback when all ranks are local.
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0;
  store_options.waitWorkers = false;  // the joined keys below wait, and name who is missing
  store_options.timeout = timeout;
  // Every rank announces itself with its world size, then waits for the others, so a rank that
  // never arrives is named here rather than reported as a bare socket timeout by Gloo, and a
  // rank started with another WORLD_SIZE is named as such. Rank 0 keeps the store up a little
  // longer, so the others can still ask who is missing.
  const auto deadline = start + timeout + (env.rank == 0 ? std::chrono::milliseconds(500) : std::chrono::milliseconds(0));
  const LaunchEnv env_copy = env;
  return run_bounded<c10::intrusive_ptr<c10d::Store>>(
      timeout + std::chrono::seconds(2),
      [host, store_options, env_copy, deadline] {
        c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
        const auto compare = [&](int r, const std::string& theirs) {
          TORCH_CHECK(theirs == std::to_string(env_copy.world_size), "rank ", r, " was started with a world size of ",
                      theirs, ", this rank with ", env_copy.world_size, "; every rank needs the same WORLD_SIZE");
        };
        const std::vector<int> missing = exchange(*store, "shardit/joined/", env_copy.rank, env_copy.world_size,
                                                  std::to_string(env_copy.world_size), deadline, compare);
        TORCH_CHECK(missing.empty(), missing_ranks(missing), " did not join");
        return store;
      },
      "no rendezvous store answered at " + store_address(env) + " (the connection was accepted but never answered: "
      "is MASTER_PORT used by another program?)");
}

void agree_through_store(c10d::Store& store, const std::string& prefix, int rank, int world_size,
                         const std::string& topic, const std::string& value, std::chrono::milliseconds timeout) {
  // Values are compared whole up to 64 KiB; longer ones (tensor tables of big checkpoints) by a
  // digest, with their start kept for the message.
  constexpr size_t kWhole = 64 * 1024;
  std::string record = topic + "\n";
  if (value.size() <= kWhole) {
    record += value;
  } else {
    record += '#';
    record += std::to_string(std::hash<std::string>{}(value));
    record += ' ';
    record += value.substr(0, 200);
  }
  const auto start = Clock::now();
  const auto fail = [&](const std::string& cause) { fail_agreement(rank, cause, start, timeout); };
  try {
    const auto compare = [&](int r, const std::string& theirs) {
      if (theirs == record) return;
      const std::string their_topic = theirs.substr(0, theirs.find('\n'));
      if (their_topic != topic) {
        fail("rank " + std::to_string(r) + " is checking '" + their_topic + "' while rank " + std::to_string(rank) +
             " checks '" + topic + "'");
      }
      size_t at = 0;
      while (at < record.size() && at < theirs.size() && record[at] == theirs[at]) ++at;
      const size_t offset = topic.size() + 1;
      at = at > offset ? at - offset : 0;
      const std::string mine = record.substr(offset);
      const std::string other = theirs.substr(offset);
      fail("ranks disagree on the " + topic + ": rank " + std::to_string(rank) + " has '" + window(mine, at) +
           "', rank " + std::to_string(r) + " has '" + window(other, at) +
           "'; every rank must run the same command on the same files");
    };
    const std::vector<int> missing = exchange(store, prefix, rank, world_size, record, start + timeout, compare);
    if (!missing.empty()) fail(missing_ranks(missing) + " did not reach the check of the " + topic + " in time");
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(error_message(e));
  }
}

}  // namespace shardit::dist
