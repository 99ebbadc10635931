#pragma once
// The server's one queue of generation requests (rank 0). Each request is a job, known by its id
// until jobs_kept newer ones have finished; the server's phase decides whether the queue takes
// requests. The HTTP handlers add jobs, cancel them and read their status; rank 0's serving loop
// (replica 0) and one dispatcher thread per other replica take them in batches.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <ctime>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shardit/serving/api.h"
#include "shardit/serving/metrics.h"
#include "shardit/serving/server.h"

namespace shardit::serving {

/// Records a stop signal: the SIGINT/SIGTERM handler (it only sets a lock-free atomic).
void note_stop_signal(int signal);
/// Records the launcher's word that a rank failed (dist::FailureNotice's value), which the same
/// handler tells from a stop signal: the server fails instead of stopping (lock-free, like above).
void note_failure_notice(int value);
/// Whether a stop signal arrived, and no failure notice (a failing server does not stop).
bool stop_asked();
/// The launcher's failure notice, when one arrived.
std::optional<int> failure_notice();

/// What an HTTP handler answers.
struct Reply {
  int status = 200;
  std::string body;
};

Reply error_reply(const ApiError& error);

enum class JobStatus { Queued, Running, Succeeded, Failed, Cancelled };

/// The status as GET /v1/jobs/{id} names it ("queued", ...).
const char* status_name(JobStatus status);

/// A generation request accepted into the queue.
struct Job {
  std::string id;
  ImageRequest request;
  std::string base_url;  ///< "http://host:port" as the client addressed the server
  std::string batch_key;  ///< ImageRequest::batch_key with batching on; empty: runs alone
  std::chrono::steady_clock::time_point arrived;
  time_t created = 0;
  std::optional<std::chrono::steady_clock::time_point> deadline;  ///< --generation-timeout after arrival
  std::promise<Reply> reply;
  bool answered = false;
  // Guarded by the queue's mutex.
  JobStatus status = JobStatus::Queued;
  std::string cancel_reason;
  // Set by the generating thread, read by GET /v1/jobs/{id}.
  std::atomic<int64_t> step{0};
  std::atomic<int64_t> steps{0};
  int64_t reference_images = 0;  ///< an edit's count, kept when its images are dropped
  // Read by rank 0 at every step boundary.
  std::atomic<bool> cancel_asked{false};

  void answer(Reply r);
  /// Drops what only the generation needed (the reference images' bytes and pixels, the
  /// prompts): a finished job keeps what GET /v1/jobs/{id} reports. Only where no other thread
  /// reads the request (a generation runs on its own copy).
  void forget_inputs();
};

/// The answer to a job cancelled for `reason` ("disconnected", "timeout").
Reply cancelled_reply(const Job& job, const std::string& reason, std::chrono::milliseconds generation_timeout);

/// The server's phase as /health names it: loading, ok, stopping, failed.
enum class Phase { Loading, Ready, Stopping, Failed };

/// What /health shows of the queue.
struct QueueView {
  Phase phase = Phase::Loading;  ///< as clients see it (a stop signal shows at once)
  std::string failure;           ///< why the server failed; empty unless it did
  size_t waiting = 0;
  bool running = false;
};

/// What a taker gets from the queue.
struct Taken {
  std::vector<std::shared_ptr<Job>> batch;  ///< each job running; empty: nothing was queued
  bool stop = false;                        ///< leave the serving loop
  std::string replica_failure;              ///< rank 0's loop only: a replica failed (the server must fail)
};

/// The queue, its jobs and the server's phase, safe to use from every thread of rank 0.
class JobQueue {
 public:
  /// `options` and `metrics` outlive the queue.
  JobQueue(const ServeOptions& options, Metrics& metrics);

  /// Loading -> ready: requests are checked against `pipeline` and queued from now on.
  void open(const pipelines::DiffusionPipeline& pipeline);
  /// The server failed with `message`: running jobs are answered 500, waiting ones 503, and new
  /// ones 503 from now on.
  void fail(const std::string& message);
  bool failed() const;

  /// The pipeline requests are checked against; throws the ApiError 503 saying why while the
  /// server takes no requests (loading, stopping, failed).
  const pipelines::DiffusionPipeline& pipeline() const;
  /// Queues `job` (a new id, or one whose job has finished); throws ApiError 503 while the server
  /// takes no requests, 429 when the queue is full, 409 when the id's job is still queued or
  /// running.
  void submit(const std::shared_ptr<Job>& job);
  /// What the handler of `job` saw while waiting for its answer: a stop signal stops accepting
  /// (every waiting request is answered 503); a non-empty `cancel_reason` ("disconnected",
  /// "timeout") cancels `job`: at once while queued, at the next step boundary while running.
  void stop_or_cancel(const std::shared_ptr<Job>& job, const std::string& cancel_reason);
  /// GET /v1/jobs/{id}: the job's status, step and queue position; 404 for an unknown id.
  Reply job_status(const std::string& id) const;
  QueueView view() const;

  /// Rank 0's serving loop: waits up to `wait` for a job or a replica's failure, then takes the
  /// next batch (take_batch); a stop signal stops accepting and says stop.
  Taken next_for_rank0(std::chrono::milliseconds wait);
  /// A dispatcher thread: waits up to 100 ms for a job, then takes the next batch; says stop
  /// after stop_dispatchers() or once the server failed.
  Taken next_for_dispatcher();
  /// The dispatchers finish their generation and stop their replica.
  void stop_dispatchers();
  /// A replica (or, from the launcher's notice, one of its ranks) was lost: the first such failure
  /// is kept, the server fails at once (fail(), whatever the replicas are doing: their running
  /// jobs are also asked to cancel, so each generation stops at its next step) and rank 0's loop
  /// is woken to exit.
  void report_replica_failure(const std::string& message);
  std::string replica_failure() const;

  /// Why `job` was cancelled while it ran; empty when no cancel was asked.
  std::string cancel_reason(const Job& job) const;
  /// Answers `job` of a finished generation and keeps it for GET /v1/jobs/{id}.
  void complete(const std::shared_ptr<Job>& job, JobStatus status, Reply reply);

 private:
  // Each below needs the lock held.
  void publish();
  void finish(const std::shared_ptr<Job>& job, JobStatus status, Reply reply);
  void fail_waiting(const ApiError& error);
  void cancel(const std::shared_ptr<Job>& job, const std::string& reason);
  std::vector<std::shared_ptr<Job>> take_batch(std::unique_lock<std::mutex>& lock);
  Phase visible_phase() const;
  void stop_accepting();
  ApiError unavailable() const;

  const ServeOptions& options_;
  Metrics& metrics_;
  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable wake_;
  Phase phase_ = Phase::Loading;
  std::string failure_;
  std::deque<std::shared_ptr<Job>> waiting_;
  std::vector<std::shared_ptr<Job>> running_;  // the jobs of the running generations (a batch's all)
  std::map<std::string, std::shared_ptr<Job>> jobs_;  // queued, running, and the last jobs_kept finished
  std::deque<std::string> finished_;                  // ids of finished jobs, oldest first
  const pipelines::DiffusionPipeline* pipeline_ = nullptr;
  bool dispatch_stopped_ = false;  // the dispatchers finish their generation and stop their replica
  std::string replica_failure_;    // set by a dispatcher whose replica was lost: the server fails
};

}  // namespace shardit::serving
