#pragma once
// The data-parallel replicas of a served mesh as rank 0 sees them, for /health and /metrics: how
// many there are, their ranks' last reports, and which are running a generation.
#include <mutex>
#include <string>
#include <vector>

#include "shardit/serving/control.h"
#include "shardit/serving/metrics.h"

namespace shardit::serving {

/// What /health shows of the replicas.
struct ReplicasView {
  int replicas = 1;
  int replica_size = 1;        ///< ranks per replica (consecutive: replica r starts at rank r x size)
  std::vector<bool> busy;      ///< per replica
  std::vector<RankReport> ranks;  ///< every rank's last report, in rank order
};

/// The replicas' state, safe to use from every thread of rank 0.
class ReplicaStatus {
 public:
  /// `metrics` outlives it.
  explicit ReplicaStatus(Metrics& metrics);
  /// `replicas` replicas of `replica_size` ranks, all idle, none reported yet.
  void set_layout(int replicas, int replica_size);
  int replicas() const;
  int replica_size() const;
  /// Keeps replica `replica`'s reports.
  void set_ranks(int replica, std::vector<RankReport> reports);
  /// Replica `replica` starts or ends a generation.
  void set_busy(int replica, bool busy);
  ReplicasView view() const;
  /// The replica that `rank` belongs to, for messages: "replica 1 (ranks 2 to 3)", "replica 1
  /// (rank 1)"; "" when the world is one replica.
  std::string replica_of(int rank) const;

 private:
  // Every rank's last report, in rank order (the caller holds the lock).
  std::vector<RankReport> all_ranks() const;

  Metrics& metrics_;
  mutable std::mutex mutex_;  // guards everything below
  int replicas_ = 1;
  int replica_size_ = 1;
  std::vector<bool> busy_;
  std::vector<std::vector<RankReport>> ranks_;  // per replica: its ranks' last reports
};

}  // namespace shardit::serving
