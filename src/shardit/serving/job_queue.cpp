#include "shardit/serving/job_queue.h"

#include <fmt/format.h>

#include <algorithm>

namespace shardit::serving {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::atomic<int> g_stop_signal{0};
std::atomic<int> g_failure_notice{0};  // 0: none (a notice's value always has its mark bits set)
static_assert(std::atomic<int>::is_always_lock_free, "the stop flag is set from a signal handler");

}  // namespace

void note_stop_signal(int signal) { g_stop_signal.store(signal); }

void note_failure_notice(int value) { g_failure_notice.store(value); }

bool stop_asked() { return g_stop_signal.load() != 0 && g_failure_notice.load() == 0; }

std::optional<int> failure_notice() {
  const int value = g_failure_notice.load();
  return value != 0 ? std::optional<int>(value) : std::nullopt;
}

Reply error_reply(const ApiError& error) { return {error.status(), error.body().dump()}; }

const char* status_name(JobStatus status) {
  static const char* names[] = {"queued", "running", "succeeded", "failed", "cancelled"};
  return names[static_cast<int>(status)];
}

void Job::answer(Reply r) {
  if (answered) return;
  answered = true;
  reply.set_value(std::move(r));
}

void Job::forget_inputs() {
  std::vector<std::string>().swap(request.images);
  std::vector<at::Tensor>().swap(request.pixels);
  std::string().swap(request.prompt);
  request.negative_prompt.reset();
}

Reply cancelled_reply(const Job& job, const std::string& reason, std::chrono::milliseconds generation_timeout) {
  const std::string at = job.steps.load() > 0 ? fmt::format(" at step {} of {}", job.step.load(), job.steps.load())
                                              : " before it started";
  if (reason == "timeout") {
    return error_reply(ApiError(
        504, fmt::format("the request took longer than --generation-timeout ({} s) and was cancelled{}",
                         std::chrono::duration<double>(generation_timeout).count(), at)));
  }
  // 499 (nginx's "client closed request"): nobody reads it, but the logs and metrics say why.
  return error_reply(ApiError(499, "the client closed its connection; the request was cancelled" + at));
}

JobQueue::JobQueue(const ServeOptions& options, Metrics& metrics) : options_(options), metrics_(metrics) {}

void JobQueue::open(const pipelines::DiffusionPipeline& pipeline) {
  std::lock_guard<std::mutex> lock(mutex_);
  pipeline_ = &pipeline;
  phase_ = Phase::Ready;
  metrics_.set_ready(true);
  publish();
}

void JobQueue::fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  phase_ = Phase::Failed;
  failure_ = message;
  metrics_.set_ready(false);
  for (const auto& job : running_) {
    finish(job, JobStatus::Failed, error_reply(ApiError(500, "the generation failed: " + message)));
  }
  running_.clear();
  fail_waiting(ApiError(503, "the server failed: " + message));
}

bool JobQueue::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phase_ == Phase::Failed;
}

const pipelines::DiffusionPipeline& JobQueue::pipeline() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (visible_phase() != Phase::Ready) throw unavailable();
  return *pipeline_;
}

void JobQueue::submit(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (visible_phase() != Phase::Ready) throw unavailable();
    if (static_cast<int64_t>(waiting_.size()) >= options_.queue_depth) {
      throw ApiError(429, fmt::format("the queue is full ({} requests waiting behind the running one); retry later",
                                      options_.queue_depth));
    }
    const auto same = jobs_.find(job->id);
    if (same != jobs_.end() &&
        (same->second->status == JobStatus::Queued || same->second->status == JobStatus::Running)) {
      throw ApiError(409, fmt::format("the X-Request-Id '{}' belongs to a job that is still {}; choose another id",
                                      job->id, status_name(same->second->status)),
                     "X-Request-Id");
    }
    jobs_[job->id] = job;
    waiting_.push_back(job);
    publish();
  }
  wake_.notify_all();
}

void JobQueue::stop_or_cancel(const std::shared_ptr<Job>& job, const std::string& cancel_reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stop_asked()) stop_accepting();
  if (!cancel_reason.empty()) cancel(job, cancel_reason);
}

Reply JobQueue::job_status(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto found = jobs_.find(id);
  if (found == jobs_.end()) {
    return error_reply(ApiError(404, fmt::format("no job '{}' (finished jobs are kept until {} newer ones finish)",
                                                 id, options_.jobs_kept)));
  }
  const Job& job = *found->second;
  json body = {{"id", job.id},
               {"object", "image.generation.job"},
               {"status", status_name(job.status)},
               {"created", job.created},
               {"step", job.step.load()},
               {"num_inference_steps", job.steps.load()},
               {"n", job.request.n},
               {"reference_images", job.reference_images}};
  // The size asked for (an edit without one takes it from its first reference image).
  if (job.request.width && job.request.height) {
    body["size"] = fmt::format("{}x{}", *job.request.width, *job.request.height);
  }
  if (job.status == JobStatus::Queued) {
    const auto at = std::find(waiting_.begin(), waiting_.end(), found->second);
    body["queue_position"] = at - waiting_.begin();
  }
  if (job.status == JobStatus::Cancelled) body["cancel_reason"] = job.cancel_reason;
  return {200, body.dump()};
}

QueueView JobQueue::view() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {visible_phase(), failure_, waiting_.size(), !running_.empty()};
}

Taken JobQueue::next_for_rank0(std::chrono::milliseconds wait) {
  Taken taken;
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_for(lock, wait, [&] { return !waiting_.empty() || !replica_failure_.empty(); });
  taken.replica_failure = replica_failure_;
  if (taken.replica_failure.empty() && stop_asked()) {
    stop_accepting();
    taken.stop = true;
    return taken;
  }
  if (taken.replica_failure.empty() && !waiting_.empty()) taken.batch = take_batch(lock);
  return taken;
}

Taken JobQueue::next_for_dispatcher() {
  Taken taken;
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_for(lock, std::chrono::milliseconds(100), [&] { return !waiting_.empty() || dispatch_stopped_; });
  if (dispatch_stopped_ || phase_ == Phase::Failed) {
    taken.stop = true;
    return taken;
  }
  if (!waiting_.empty()) taken.batch = take_batch(lock);
  return taken;
}

void JobQueue::stop_dispatchers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dispatch_stopped_ = true;
  }
  wake_.notify_all();
}

void JobQueue::report_replica_failure(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!replica_failure_.empty()) return;
    replica_failure_ = message;
    for (const auto& job : running_) job->cancel_asked.store(true);
  }
  fail(message);
  wake_.notify_all();
}

std::string JobQueue::replica_failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return replica_failure_;
}

std::string JobQueue::cancel_reason(const Job& job) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return job.cancel_asked.load() ? job.cancel_reason : std::string();
}

void JobQueue::complete(const std::shared_ptr<Job>& job, JobStatus status, Reply reply) {
  std::lock_guard<std::mutex> lock(mutex_);
  job->forget_inputs();  // its generation has ended
  if (job->answered) return;  // the server failed meanwhile (fail() answered it)
  // No longer running in the metrics before its client can read them.
  running_.erase(std::remove(running_.begin(), running_.end(), job), running_.end());
  publish();
  finish(job, status, std::move(reply));
}

void JobQueue::publish() {
  metrics_.set_queue(static_cast<int64_t>(waiting_.size()), options_.queue_depth, !running_.empty());
}

// Answers `job` and keeps it for GET /v1/jobs/{id}: without its inputs unless a generation may
// still read them (a running job answered because the server failed).
void JobQueue::finish(const std::shared_ptr<Job>& job, JobStatus status, Reply reply) {
  if (job->status != JobStatus::Running) job->forget_inputs();
  job->status = status;
  job->answer(std::move(reply));
  finished_.push_back(job->id);
  while (finished_.size() > options_.jobs_kept) {
    const auto found = jobs_.find(finished_.front());
    if (found != jobs_.end() && found->second->status != JobStatus::Queued &&
        found->second->status != JobStatus::Running) {
      jobs_.erase(found);
    }
    finished_.pop_front();
  }
}

// Answers every waiting request with `error`.
void JobQueue::fail_waiting(const ApiError& error) {
  for (auto& job : waiting_) finish(job, JobStatus::Failed, error_reply(error));
  waiting_.clear();
  publish();
}

// Cancels `job` for `reason`: a queued job leaves the queue and is answered now; a running one
// stops at its next step boundary, on every rank (its serving loop answers it).
void JobQueue::cancel(const std::shared_ptr<Job>& job, const std::string& reason) {
  if (job->status == JobStatus::Queued) {
    const auto found = std::find(waiting_.begin(), waiting_.end(), job);
    if (found != waiting_.end()) waiting_.erase(found);
    job->cancel_reason = reason;
    finish(job, JobStatus::Cancelled, cancelled_reply(*job, reason, options_.generation_timeout));
    metrics_.count_cancelled(reason);
    publish();
  } else if (job->status == JobStatus::Running && !job->cancel_asked.load()) {
    job->cancel_reason = reason;
    job->cancel_asked.store(true);
  }
}

// Takes the next job and, with batching on, the queued jobs that share its batch key, waiting up
// to --batch-wait for more while the batch has room (the lock is released while waiting). Each
// taken job is running.
std::vector<std::shared_ptr<Job>> JobQueue::take_batch(std::unique_lock<std::mutex>& lock) {
  std::vector<std::shared_ptr<Job>> batch = {waiting_.front()};
  waiting_.pop_front();
  // Running from the moment it is taken: a cancel while the batch waits for more is then asked
  // of the generation, not answered twice.
  const auto start_running = [this](const std::shared_ptr<Job>& job) {
    job->status = JobStatus::Running;
    running_.push_back(job);
  };
  start_running(batch.front());
  int64_t images = batch.front()->request.n;
  const std::string& key = batch.front()->batch_key;
  const auto deadline = Clock::now() + options_.batch_wait;
  while (!key.empty() && images < options_.max_batch) {
    for (auto it = waiting_.begin(); it != waiting_.end() && images < options_.max_batch;) {
      if ((*it)->batch_key == key && images + (*it)->request.n <= options_.max_batch) {
        images += (*it)->request.n;
        batch.push_back(*it);
        start_running(*it);
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    if (images >= options_.max_batch || Clock::now() >= deadline || stop_asked()) break;
    wake_.wait_until(lock, deadline);
  }
  publish();
  return batch;
}

// The phase clients see: a stop signal shows at once, before the serving loop (perhaps inside a
// generation) notices it.
Phase JobQueue::visible_phase() const {
  return stop_asked() && (phase_ == Phase::Loading || phase_ == Phase::Ready) ? Phase::Stopping : phase_;
}

// Stops taking requests and answers every waiting one 503.
void JobQueue::stop_accepting() {
  if (phase_ == Phase::Loading || phase_ == Phase::Ready) phase_ = Phase::Stopping;
  metrics_.set_ready(false);
  fail_waiting(ApiError(503, "the server is shutting down"));
}

// The error for a request that cannot be served now.
ApiError JobQueue::unavailable() const {
  switch (visible_phase()) {
    case Phase::Loading: return ApiError(503, "the model is still loading; retry when GET /health answers 200");
    case Phase::Stopping: return ApiError(503, "the server is shutting down");
    default: return ApiError(503, "the server failed: " + failure_);
  }
}

}  // namespace shardit::serving
