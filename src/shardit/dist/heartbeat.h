#pragma once
// Liveness of the ranks of a world (internal to dist/): each rank bumps a counter in the
// rendezvous store from a thread of its own, so that a failed collective can name the rank that
// was lost, and say whether it exited, was stopped or stopped answering.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shardit::dist {

/// Each rank increments its counter in the store every 200 ms from its own thread (and its own
/// store connection, so a collective blocked in the store never delays it). A rank whose counter
/// stands still over a second has exited, crashed, or been stopped.
class Heartbeat {
 public:
  /// Starts the heartbeat of `rank` on a connection of its own to the store at host:port (one
  /// that a blocked store call of the rank never holds up); `timeout` bounds its store calls
  /// (at most 5 s).
  static std::unique_ptr<Heartbeat> start(const std::string& host, int port, int rank,
                                          std::chrono::milliseconds timeout);

  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank);
  ~Heartbeat();

  /// Stops the thread (for good); what it published stays in the store.
  void stop();

  /// A sentence about the members of `global_ranks` (other than this rank) that were lost;
  /// `when_alive` when none was. Watches the counters for about a second.
  std::string lost_ranks(const std::vector<int>& global_ranks,
                         const std::string& when_alive = "every other member is still alive");

  /// The counters of `ranks` now.
  std::vector<int64_t> read(const std::vector<int>& ranks);

 private:
  void run();

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  std::mutex store_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace shardit::dist
