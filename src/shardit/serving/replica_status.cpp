#include "shardit/serving/replica_status.h"

#include <fmt/format.h>

namespace shardit::serving {

ReplicaStatus::ReplicaStatus(Metrics& metrics) : metrics_(metrics) {}

void ReplicaStatus::set_layout(int replicas, int replica_size) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    replicas_ = replicas;
    replica_size_ = replica_size;
    busy_.assign(static_cast<size_t>(replicas), false);
    ranks_.assign(static_cast<size_t>(replicas), {});
  }
  metrics_.set_replicas(replicas);
}

int ReplicaStatus::replicas() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return replicas_;
}

int ReplicaStatus::replica_size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return replica_size_;
}

void ReplicaStatus::set_ranks(int replica, std::vector<RankReport> reports) {
  std::lock_guard<std::mutex> lock(mutex_);
  ranks_[static_cast<size_t>(replica)] = std::move(reports);
  metrics_.set_ranks(all_ranks());
}

void ReplicaStatus::set_busy(int replica, bool busy) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_[static_cast<size_t>(replica)] = busy;
  }
  metrics_.set_replica_busy(replica, busy);
}

ReplicasView ReplicaStatus::view() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {replicas_, replica_size_, busy_, all_ranks()};
}

std::string ReplicaStatus::replica_of(int rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (replicas_ <= 1) return "";
  const int replica = rank / replica_size_;
  const int first = replica * replica_size_;
  return replica_size_ == 1 ? fmt::format("replica {} (rank {})", replica, first)
                            : fmt::format("replica {} (ranks {} to {})", replica, first, first + replica_size_ - 1);
}

std::vector<RankReport> ReplicaStatus::all_ranks() const {
  std::vector<RankReport> out;
  for (const auto& replica : ranks_) out.insert(out.end(), replica.begin(), replica.end());
  return out;
}

}  // namespace shardit::serving
