#include "shardit/serving/replica_dispatch.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <string>

#include "shardit/core/error.h"
#include "shardit/dist/world.h"

namespace shardit::serving {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

/// How long a replica rank's heartbeat (200 ms) may stand still before its replica is lost.
constexpr auto kHeartbeatSilence = std::chrono::seconds(3);

/// How often a replica's first rank looks for work and rank 0's dispatcher for its replica's word
/// (a few store round trips each time): the latency it adds to a request on another replica.
constexpr auto kMailboxPoll = std::chrono::milliseconds(10);

/// The mailbox keys (dist::World::post) between rank 0 and the first rank of replica `replica`.
std::string replica_key(int replica, const char* what) { return fmt::format("serve/replica{}/{}", replica, what); }

json reports_json(const std::vector<RankReport>& reports) {
  json out = json::array();
  for (const RankReport& r : reports) {
    out.push_back({{"rank", r.rank}, {"pid", r.pid}, {"rss", r.rss_bytes}, {"peak", r.peak_rss_bytes},
                   {"failed", r.failed}});
  }
  return out;
}

std::vector<RankReport> reports_from_json(const json& in) {
  std::vector<RankReport> out;
  for (const json& r : in) {
    out.push_back({r.at("rank").get<int>(), r.at("pid").get<int64_t>(), r.at("rss").get<int64_t>(),
                   r.at("peak").get<int64_t>(), r.at("failed").get<int64_t>()});
  }
  return out;
}

}  // namespace

/// A dispatcher's watch over its replica: check() throws when the replica posted a failure or one
/// of its ranks' heartbeats stood still for kHeartbeatSilence, and keeps the reports it posts.
class ReplicaDispatch::Watch {
 public:
  Watch(int replica, ReplicaStatus& replicas)
      : world_(dist::World::get()), replica_(replica), replicas_(replicas),
        members_(static_cast<size_t>(replicas.replica_size())) {
    std::iota(members_.begin(), members_.end(), replica * replicas.replica_size());
    beats_ = world_.heartbeats(members_);
    beats_read_ = Clock::now();
  }

  /// The replica's ranks.
  const std::vector<int>& members() const { return members_; }

  void check() {
    if (const std::optional<std::string> failed = world_.take(replica_key(replica_, "failed"))) {
      TORCH_CHECK(false, *failed);
    }
    if (const std::optional<std::string> reports = world_.take(replica_key(replica_, "ranks"))) {
      replicas_.set_ranks(replica_, reports_from_json(json::parse(*reports)));
    }
    if (Clock::now() - beats_read_ < kHeartbeatSilence) return;
    const std::vector<int64_t> now = world_.heartbeats(members_);
    for (size_t i = 0; i < members_.size(); ++i) {
      if (now[i] == beats_[i]) {
        const std::string lost = world_.lost_ranks(members_);
        TORCH_CHECK(false, lost.empty() ? fmt::format("rank {} stopped beating", members_[i]) : lost);
      }
    }
    beats_ = now;
    beats_read_ = Clock::now();
  }

 private:
  dist::World& world_;
  const int replica_;
  ReplicaStatus& replicas_;
  std::vector<int> members_;
  std::vector<int64_t> beats_;
  Clock::time_point beats_read_;
};

ReplicaDispatch::ReplicaDispatch(JobQueue& queue, ReplicaStatus& replicas, JobAnswers& answers)
    : queue_(queue), replicas_(replicas), answers_(answers) {}

ReplicaDispatch::~ReplicaDispatch() {
  if (!threads_.empty()) stop();
}

void ReplicaDispatch::start() {
  for (int r = 1; r < replicas_.replicas(); ++r) threads_.emplace_back([this, r] { dispatch(r); });
}

void ReplicaDispatch::stop() {
  queue_.stop_dispatchers();
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
}

// Replica `replica`'s thread: while the replica is free, hands it the next queued jobs (a batch,
// as rank 0's serving loop takes them), until stop() or the server's failure.
void ReplicaDispatch::dispatch(int replica) {
  dist::World& world = dist::World::get();
  Watch watch(replica, replicas_);
  try {
    int64_t sequence = 0;
    for (;;) {
      const Taken next = queue_.next_for_dispatcher();
      if (next.stop) break;
      if (next.batch.empty()) {
        watch.check();
        continue;
      }
      replicas_.set_busy(replica, true);
      if (!run_batch(replica, next.batch, ++sequence, watch)) return;
    }
    if (queue_.failed()) return;
    world.post(replica_key(replica, "stop"), "1");
    while (!world.take(replica_key(replica, "stopped"))) {
      watch.check();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception& e) {
    queue_.report_replica_failure(
        fmt::format("{} failed: {}", replicas_.replica_of(watch.members().front()), error_message(e)));
  }
}

// Hands `batch` to replica `replica` as its generation `sequence` and answers its jobs from the
// outcomes posted back, passing their progress and cancellation along; false when the server
// failed meanwhile (which answered the jobs). The replica is marked free (its generation counted)
// before the answers go out, so a client that has its answer reads metrics that include it.
bool ReplicaDispatch::run_batch(int replica, const std::vector<std::shared_ptr<Job>>& batch, int64_t sequence,
                                Watch& watch) {
  dist::World& world = dist::World::get();
  json message = {{"sequence", sequence}, {"requests", json::array()}};
  for (const auto& job : batch) message["requests"].push_back(job->request.to_json());
  world.post(replica_key(replica, "job"), message.dump());
  bool cancel_posted = false;
  for (;;) {
    std::this_thread::sleep_for(kMailboxPoll);
    if (queue_.failed()) return false;
    if (const std::optional<std::string> posted = world.take(replica_key(replica, "result"))) {
      const json result = json::parse(*posted);
      std::vector<JobOutcome> outcomes;
      for (const json& outcome : result.at("outcomes")) outcomes.push_back(JobOutcome::from_json(outcome));
      replicas_.set_busy(replica, false);
      answers_.answer(batch, outcomes, result.at("seconds").get<double>(), replica);
      return true;
    }
    if (const std::optional<std::string> posted = world.take(replica_key(replica, "progress"))) {
      const json progress = json::parse(*posted);
      for (const auto& job : batch) {
        job->steps.store(progress.at("steps").get<int64_t>());
        job->step.store(progress.at("step").get<int64_t>());
      }
    }
    const bool all_cancelled = std::all_of(batch.begin(), batch.end(),
                                           [](const std::shared_ptr<Job>& job) { return job->cancel_asked.load(); });
    if (all_cancelled && !cancel_posted) {
      world.post(replica_key(replica, "cancel"), std::to_string(sequence));
      cancel_posted = true;
    }
    watch.check();
  }
}

int serve_replica(ReplicaGenerations& generations, ControlPlane& plane, std::chrono::milliseconds tick, int replica) {
  dist::World& world = dist::World::get();
  try {
    world.post(replica_key(replica, "ranks"), reports_json(plane.report(false)).dump());
    auto last_message = Clock::now();
    for (;;) {
      if (world.take(replica_key(replica, "stop"))) break;
      const std::optional<std::string> posted = world.take(replica_key(replica, "job"));
      if (!posted) {
        if (Clock::now() - last_message >= tick) {
          plane.send(ControlKind::Tick);
          world.post(replica_key(replica, "ranks"), reports_json(plane.report(false)).dump());
          last_message = Clock::now();
        }
        std::this_thread::sleep_for(kMailboxPoll);
        continue;
      }
      const json message = json::parse(*posted);
      const int64_t sequence = message.at("sequence").get<int64_t>();
      std::vector<ImageRequest> requests;
      for (const json& request : message.at("requests")) requests.push_back(ImageRequest::from_json(request));
      auto cancelled = std::make_shared<bool>(false);
      JobLink link;
      link.progress = [&world, replica, sequence](int64_t done, int64_t total) {
        world.post(replica_key(replica, "progress"),
                   json{{"sequence", sequence}, {"step", done}, {"steps", total}}.dump());
      };
      link.cancelled = [&world, replica, sequence, cancelled] {
        if (!*cancelled) {
          const std::optional<std::string> asked = world.take(replica_key(replica, "cancel"));
          *cancelled = asked && *asked == std::to_string(sequence);
        }
        return *cancelled;
      };
      const auto start = Clock::now();
      std::vector<RankReport> reports;
      const std::vector<JobOutcome> outcomes =
          generations.run(requests, std::vector<JobLink>(requests.size(), link), &reports);
      last_message = Clock::now();
      world.post(replica_key(replica, "ranks"), reports_json(reports).dump());
      json answer = {{"sequence", sequence}, {"seconds", seconds_between(start, last_message)},
                     {"outcomes", json::array()}};
      for (const JobOutcome& outcome : outcomes) answer["outcomes"].push_back(outcome.to_json());
      world.post(replica_key(replica, "result"), answer.dump());
    }
    plane.send(ControlKind::Stop);
    plane.report(false);
    world.post(replica_key(replica, "stopped"), "1");
    return 0;
  } catch (const std::exception& e) {
    try {
      world.post(replica_key(replica, "failed"), error_message(e));
    } catch (const std::exception&) {
      // the store is gone with rank 0: nobody to tell
    }
    throw;
  }
}

}  // namespace shardit::serving
