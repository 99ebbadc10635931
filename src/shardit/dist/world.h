#pragma once
// The process-wide distributed runtime: rendezvous through c10d's TCPStore, the world group, the
// rank's device and thread count, and sub-groups.
#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/dist/group.h"
#include "shardit/dist/launch_env.h"

namespace shardit::dist {

struct InitOptions {
  /// Rendezvous and collective timeout: a peer that vanished is reported after at most this long.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  /// "auto" (cuda:LOCAL_RANK when CUDA is available, else cpu), "cpu" or "cuda".
  std::string device = "auto";
  /// Intra-op CPU threads for this rank; 0: hardware cores / local ranks (at least 1).
  int threads = 0;
};

/// The world this process belongs to. A single process with no launcher variables is rank 0 of 1
/// and needs no store.
class World {
 public:
  /// Initialises once from LaunchEnv::from_environment(); later calls return the same world.
  static World& init(const InitOptions& options = {});
  /// The initialised world (init() with defaults if nobody called it).
  static World& get();
  static bool initialized();

  const LaunchEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int size() const { return env_.world_size; }
  at::Device device() const { return device_; }
  const InitOptions& options() const { return options_; }
  /// All ranks.
  std::shared_ptr<Group> group() const { return world_group_; }
  /// Checks that every rank has the same `value` for `topic` (the model config, the compute
  /// dtype, the input shapes) before any collective depends on it: through the rendezvous store,
  /// so a disagreement is a named error instead of a transport failure inside a collective. A
  /// collective call: every rank calls it, in the same order. No-op on a world of one.
  void agree(const std::string& topic, const std::string& value);
  /// A group over `ranks` (global ranks). Collective over the world: every rank calls it, in the
  /// same order, with the same list; a rank outside `ranks` gets nullptr.
  std::shared_ptr<Group> new_group(const std::vector<int>& ranks);

  /// Messages through the rendezvous store (c10d's TCPStore, hosted by rank 0) between ranks that
  /// cannot meet in a collective, such as a server's dispatcher and a replica busy with its own
  /// requests: post() sets `key` to `value` (replacing it); take() returns and removes it when it
  /// is there, nullopt otherwise, without waiting. One reader per key. Thread-safe. Errors are
  /// c10d's (the store is gone when rank 0 is).
  void post(const std::string& key, const std::string& value);
  std::optional<std::string> take(const std::string& key);
  /// The members of `ranks` whose heartbeat stands still, in a sentence ("lost rank 3 (exited,
  /// crashed or was killed)"); "" when all are alive or on a world of one. Watches for about a
  /// second.
  std::string lost_ranks(const std::vector<int>& ranks);
  /// The heartbeat counters of `ranks` now (each rank bumps its own every 200 ms from a thread of
  /// its own): one that stands still for seconds belongs to a lost rank. Zeros on a world of one.
  std::vector<int64_t> heartbeats(const std::vector<int>& ranks);

 private:
  World() = default;
  struct Impl;
  std::shared_ptr<Impl> impl_;
  LaunchEnv env_;
  InitOptions options_;
  at::Device device_{at::kCPU};
  std::shared_ptr<Group> world_group_;
};

}  // namespace shardit::dist
