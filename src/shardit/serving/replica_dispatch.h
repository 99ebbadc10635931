#pragma once
// The data-parallel replicas other than replica 0 (serve --replicas). Rank 0 runs a dispatcher
// thread per such replica that hands the replica's first rank the next queued batch whenever the
// replica is free and answers its jobs from the outcomes the first rank posts back, passing their
// progress and cancellation along; the two talk through the rendezvous store's mailboxes
// (dist::World::post and take). Inside the replica, its first rank drives the other ranks over
// the replica's control plane (generation.h).
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "shardit/serving/generation.h"
#include "shardit/serving/job_answers.h"
#include "shardit/serving/job_queue.h"
#include "shardit/serving/replica_status.h"

namespace shardit::serving {

/// Rank 0's dispatcher threads. Each watches its replica's ranks' heartbeats: a replica that
/// fails or loses a rank fails the whole server (JobQueue::report_replica_failure, which rank 0's
/// serving loop turns into the server's failure; docs/serving.md says why).
class ReplicaDispatch {
 public:
  /// `queue`, `replicas` and `answers` outlive it.
  ReplicaDispatch(JobQueue& queue, ReplicaStatus& replicas, JobAnswers& answers);
  /// Stops the dispatchers still running.
  ~ReplicaDispatch();
  /// Starts a dispatcher for every replica but replica 0.
  void start();
  /// The dispatchers finish their generation and stop their replica; returns when they have.
  void stop();

 private:
  class Watch;
  void dispatch(int replica);
  bool run_batch(int replica, const std::vector<std::shared_ptr<Job>>& batch, int64_t sequence, Watch& watch);

  JobQueue& queue_;
  ReplicaStatus& replicas_;
  JobAnswers& answers_;
  std::vector<std::thread> threads_;
};

/// A replica's first rank other than rank 0: runs on its replica the generations rank 0's
/// dispatcher posts to it and posts back their outcomes, reporting each step and taking a
/// cancellation at each step boundary. Between them it keeps its replica's ranks in touch (a
/// control message every `tick`) and stops them when rank 0 says so; returns 0. A failure is
/// posted for rank 0 before it is thrown.
int serve_replica(ReplicaGenerations& generations, ControlPlane& plane, std::chrono::milliseconds tick, int replica);

}  // namespace shardit::serving
