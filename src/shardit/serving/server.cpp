#include "shardit/serving/server.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <httplib.h>
#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <regex>
#include <thread>

#include "shardit/core/error.h"
#include "shardit/core/notes.h"
#include "shardit/dist/world.h"
#include "shardit/io/file.h"
#include "shardit/io/png.h"
#include "shardit/nn/linear.h"
#include "shardit/serving/base64.h"
#include "shardit/serving/control.h"
#include "shardit/serving/metrics.h"

namespace shardit::serving {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the stop flag is set from a signal handler");

void on_stop_signal(int signal) { g_stop_signal.store(signal); }

/// A Host header that is only a host name, IPv4 or [IPv6] address, with an optional port: what
/// may be echoed into a URL (anything else could inject text into the answer).
bool is_plain_host(const std::string& host) {
  static const std::regex plain(R"(^([A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])(:[0-9]{1,5})?$)");
  return std::regex_match(host, plain);
}

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

/// What an HTTP handler answers.
struct Reply {
  int status = 200;
  std::string body;
};

Reply error_reply(const ApiError& error) { return {error.status(), error.body().dump()}; }

enum class JobStatus { Queued, Running, Succeeded, Failed, Cancelled };

const char* status_name(JobStatus status) {
  static const char* names[] = {"queued", "running", "succeeded", "failed", "cancelled"};
  return names[static_cast<int>(status)];
}

/// A generation request accepted into the queue: a job, known by its id until jobs_kept newer
/// ones have finished.
struct Job {
  std::string id;
  ImageRequest request;
  std::string base_url;  ///< "http://host:port" as the client addressed the server
  std::string batch_key;  ///< ImageRequest::batch_key with batching on; empty: runs alone
  Clock::time_point arrived;
  time_t created = 0;
  std::optional<Clock::time_point> deadline;  ///< --generation-timeout after arrival
  std::promise<Reply> reply;
  bool answered = false;
  // Guarded by State::mutex.
  JobStatus status = JobStatus::Queued;
  std::string cancel_reason;
  // Set by the generating thread, read by GET /v1/jobs/{id}.
  std::atomic<int64_t> step{0};
  std::atomic<int64_t> steps{0};
  // Read by rank 0 at every step boundary.
  std::atomic<bool> cancel_asked{false};

  void answer(Reply r) {
    if (answered) return;
    answered = true;
    reply.set_value(std::move(r));
  }
};

/// How a generation reports a request's progress and learns that it is cancelled: bound to the
/// job on rank 0, to the dispatcher's mailbox on another replica's first rank; empty on the
/// ranks that only compute.
struct JobLink {
  std::function<void(int64_t done, int64_t total)> progress;
  std::function<bool()> cancelled;
};

/// What became of one request of a generation, as a replica's first rank hands it to rank 0:
/// its images as PNG files, or why there are none.
struct JobOutcome {
  enum class Kind { Images, Cancelled, Failed };
  Kind kind = Kind::Failed;
  std::vector<std::string> pngs;
  int64_t width = 0;
  int64_t height = 0;
  int64_t steps = 0;
  std::vector<std::string> warnings;
  std::string failure;

  json to_json() const {
    json encoded = json::array();
    for (const std::string& png : pngs) encoded.push_back(base64_encode(png));
    return {{"kind", static_cast<int>(kind)}, {"pngs", encoded}, {"width", width}, {"height", height},
            {"steps", steps}, {"warnings", warnings}, {"failure", failure}};
  }
  static JobOutcome from_json(const json& in) {
    JobOutcome out;
    out.kind = static_cast<Kind>(in.at("kind").get<int>());
    for (const auto& png : in.at("pngs")) out.pngs.push_back(base64_decode(png.get<std::string>()).value());
    out.width = in.at("width").get<int64_t>();
    out.height = in.at("height").get<int64_t>();
    out.steps = in.at("steps").get<int64_t>();
    out.warnings = in.at("warnings").get<std::vector<std::string>>();
    out.failure = in.at("failure").get<std::string>();
    return out;
  }
};

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

/// How long a replica rank's heartbeat (200 ms) may stand still before its replica is lost.
constexpr auto kHeartbeatSilence = std::chrono::seconds(3);

/// How often a replica's first rank looks for work and rank 0's dispatcher for its replica's word
/// (a few store round trips each time): the latency it adds to a request on another replica.
constexpr auto kMailboxPoll = std::chrono::milliseconds(10);

/// The mailbox keys (dist::World::post) between rank 0 and the first rank of replica `replica`.
std::string replica_key(int replica, const char* what) { return fmt::format("serve/replica{}/{}", replica, what); }

/// Thrown on every rank at the same step boundary when rank 0 cancels the running generation.
struct GenerationCancelled : std::exception {
  const char* what() const noexcept override { return "the generation was cancelled"; }
};

/// An X-Request-Id a client may choose: what is safe to echo in a header, a path and a log.
bool is_plain_request_id(const std::string& id) {
  static const std::regex plain(R"(^[A-Za-z0-9._:-]{1,128}$)");
  return std::regex_match(id, plain);
}

std::string new_request_id() {
  static std::mutex mutex;
  static std::mt19937_64 engine{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mutex);
  return fmt::format("img-{:016x}", engine());
}

/// A note as a client may read it: the server's folders left out of every path it names
/// ("/srv/models/FLUX.1-dev/tokenizer_2: prompt has ..." -> "tokenizer_2: prompt has ...").
std::string client_note(const std::string& note) {
  static const std::regex path(R"((?:[^\s:'"/]*/)+([^\s:'"/]+))");
  return std::regex_replace(note, path, "$1");
}

/// The adapters of a request as set_adapters takes them, and as the answer lists them.
nlohmann::json lora_json(const std::vector<LoraChoice>& lora) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& choice : lora) out.push_back({{"name", choice.name}, {"scale", choice.scale}});
  return out;
}

/// The endpoint label of a path in the request counters.
std::string endpoint_of(const std::string& path) {
  if (path == "/v1/images/generations") return "generations";
  if (path == "/v1/images/edits") return "edits";
  if (path == "/v1/models") return "models";
  if (path == "/health") return "health";
  if (path == "/metrics") return "metrics";
  if (path.rfind("/v1/jobs/", 0) == 0) return "jobs";
  if (path.rfind("/images/", 0) == 0) return "images";
  return "other";
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
}

enum class Phase { Loading, Ready, Stopping, Failed };

struct Server::State {
  ServeOptions options;
  Metrics metrics;
  std::unique_ptr<HttpServer> http;  // rank 0 only, from listen()
  std::thread listener;
  bool listening = false;
  time_t started = std::time(nullptr);

  std::mutex mutex;  // guards everything below
  std::condition_variable wake;
  Phase phase = Phase::Loading;
  std::string failure;
  std::deque<std::shared_ptr<Job>> waiting;
  std::vector<std::shared_ptr<Job>> running;  // the jobs of the running generation (a batch's all)
  std::map<std::string, std::shared_ptr<Job>> jobs;  // queued, running, and the last jobs_kept finished
  std::deque<std::string> finished;                  // ids of finished jobs, oldest first
  std::vector<std::vector<RankReport>> ranks;  // per replica: its ranks' last reports
  const pipelines::DiffusionPipeline* pipeline = nullptr;
  int replicas = 1;
  int replica_size = 1;
  std::vector<bool> replica_busy;  // replicas' state for /health
  bool stop_dispatch = false;      // the dispatchers finish their generation and stop their replica
  std::string replica_failure;     // set by a dispatcher whose replica was lost: the server fails
  uint64_t images_written = 0;

  void publish_queue() { metrics.set_queue(static_cast<int64_t>(waiting.size()), options.queue_depth, !running.empty()); }

  // The adapters active now on every rank (lora_json of what was set last); only generate() changes it.
  std::string active_lora;

  // Answers `job` and keeps it for GET /v1/jobs/{id} (the caller holds the lock).
  void finish(const std::shared_ptr<Job>& job, JobStatus status, Reply reply) {
    job->status = status;
    job->answer(std::move(reply));
    finished.push_back(job->id);
    while (finished.size() > options.jobs_kept) {
      const auto found = jobs.find(finished.front());
      if (found != jobs.end() && found->second->status != JobStatus::Queued &&
          found->second->status != JobStatus::Running) {
        jobs.erase(found);
      }
      finished.pop_front();
    }
  }

  // Answers every waiting request with `error` (the caller holds the lock).
  void fail_waiting(const ApiError& error) {
    for (auto& job : waiting) finish(job, JobStatus::Failed, error_reply(error));
    waiting.clear();
    publish_queue();
  }

  // The answer to a cancelled job.
  Reply cancelled_reply(const Job& job, const std::string& reason) const {
    const std::string at = job.steps.load() > 0 ? fmt::format(" at step {} of {}", job.step.load(), job.steps.load())
                                                : " before it started";
    if (reason == "timeout") {
      return error_reply(ApiError(
          504, fmt::format("the request took longer than --generation-timeout ({} s) and was cancelled{}",
                           std::chrono::duration<double>(options.generation_timeout).count(), at)));
    }
    // 499 (nginx's "client closed request"): nobody reads it, but the logs and metrics say why.
    return error_reply(ApiError(499, "the client closed its connection; the request was cancelled" + at));
  }

  // Cancels `job` for `reason` ("disconnected", "timeout"; the caller holds the lock): a queued
  // job leaves the queue and is answered now; a running one stops at its next step boundary, on
  // every rank (the serving loop answers it).
  void cancel(const std::shared_ptr<Job>& job, const std::string& reason) {
    if (job->status == JobStatus::Queued) {
      const auto found = std::find(waiting.begin(), waiting.end(), job);
      if (found != waiting.end()) waiting.erase(found);
      job->cancel_reason = reason;
      finish(job, JobStatus::Cancelled, cancelled_reply(*job, reason));
      metrics.count_cancelled(reason);
      publish_queue();
    } else if (job->status == JobStatus::Running && !job->cancel_asked.load()) {
      job->cancel_reason = reason;
      job->cancel_asked.store(true);
    }
  }

  // Runs `request` on this rank (collective: every rank calls it with the same request): its
  // LoRA adapters (switched, never reloaded), then the pipeline, with a step boundary after every
  // step at which rank 0 tells every rank whether `job` (rank 0's; null elsewhere) is cancelled.
  pipelines::GenerateResult generate(pipelines::DiffusionPipeline& pipeline, const ImageRequest& request,
                                     ControlPlane& plane, const JobLink* link) {
    use_lora(pipeline, request.lora);
    pipelines::GenerateRequest call = request.to_generate();
    call.on_progress = [&plane, link](int64_t done, int64_t total) {
      if (link != nullptr) link->progress(done, total);
      if (done == 0) return;
      if (plane.step_boundary(link != nullptr && link->cancelled())) throw GenerationCancelled();
    };
    return pipeline.generate(call);
  }

  // Makes `lora` the active adapters on this rank (collective: every rank switches alike).
  void use_lora(pipelines::DiffusionPipeline& pipeline, const std::vector<LoraChoice>& lora) {
    if (options.lora.empty() || options.fuse_lora) return;
    const std::string wanted = lora_json(lora).dump();
    if (wanted == active_lora) return;
    const auto start = Clock::now();
    std::vector<std::string> names;
    std::vector<double> weights;
    for (const auto& choice : lora) {
      names.push_back(choice.name);
      weights.push_back(choice.scale);
    }
    pipeline.lora_adapters().set_adapters(names, weights);
    active_lora = wanted;
    metrics.observe_lora_switch(seconds_between(start, Clock::now()));
  }

  // Runs requests that share a batch key as one batch on this rank (collective like generate()):
  // after each step rank 0 tells every rank whether every job of the running batch is cancelled
  // (`links`: one per request on the replica's first rank; empty elsewhere), which stops it
  // there. A job cancelled while others of its batch go on is answered when the batch ends.
  std::vector<std::optional<pipelines::GenerateResult>> generate_batch(pipelines::DiffusionPipeline& pipeline,
                                                                       const std::vector<ImageRequest>& requests,
                                                                       ControlPlane& plane,
                                                                       const std::vector<JobLink>& links) {
    use_lora(pipeline, requests.front().lora);
    std::vector<pipelines::GenerateRequest> calls;
    for (const ImageRequest& request : requests) calls.push_back(request.to_generate());
    return pipeline.generate_batch(calls, [&](const std::vector<size_t>& members, int64_t done, int64_t total) {
      bool all_cancelled = !links.empty();
      for (const size_t i : members) {
        if (links.empty()) break;
        links[i].progress(done, total);
        all_cancelled = all_cancelled && links[i].cancelled();
      }
      if (done == 0) return false;
      return plane.step_boundary(all_cancelled);
    });
  }

  // One generation on this replica, whose first rank this is (collective over the replica
  // through `plane`): the control message, the generation (alone, or as a batch) with a step
  // boundary after every step, every rank's report. Each request's outcome, with its images as
  // PNGs; `reports` gets the ranks' reports. A failed collective (a lost rank) throws.
  std::vector<JobOutcome> run_generation(pipelines::DiffusionPipeline& pipeline, ControlPlane& plane,
                                         const std::vector<ImageRequest>& requests, const std::vector<JobLink>& links,
                                         std::vector<RankReport>* reports) {
    std::vector<std::optional<pipelines::GenerateResult>> results(requests.size());
    std::string failure;
    std::vector<std::string> shared_warnings;  // the notes of the shared run, for every request
    try {
      NoteCollector notes;
      if (requests.size() == 1) {
        plane.send(ControlKind::Generate, requests.front().to_json().dump());
        try {
          results.front() = generate(pipeline, requests.front(), plane, &links.front());
        } catch (const GenerationCancelled&) {
        }
      } else {
        json payload = json::array();
        for (const ImageRequest& request : requests) payload.push_back(request.to_json());
        plane.send(ControlKind::GenerateBatch, payload.dump());
        results = generate_batch(pipeline, requests, plane, links);
      }
      for (const auto& note : notes.notes()) shared_warnings.push_back(client_note(note));
    } catch (const std::exception& e) {
      failure = error_message(e);
    }
    *reports = plane.report(!failure.empty());
    for (const auto& r : *reports) {
      if (failure.empty() && r.failed) failure = fmt::format("the generation failed on rank {}", r.rank);
    }
    std::vector<JobOutcome> outcomes(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      JobOutcome& out = outcomes[i];
      if (!failure.empty()) {
        out.failure = failure;
        continue;
      }
      if (!results[i] || links[i].cancelled()) {
        out.kind = JobOutcome::Kind::Cancelled;
        continue;
      }
      const pipelines::GenerateResult& result = *results[i];
      try {
        const std::vector<std::pair<std::string, std::string>> text = {
            {"prompt", requests[i].prompt},
            {"seed", std::to_string(requests[i].seed)},
            {"steps", std::to_string(result.num_inference_steps)},
            {"model", options.model_id},
            {"Software", "shardit"}};
        for (int64_t k = 0; k < result.image.size(0); ++k) {
          out.pngs.push_back(io::encode_png(io::to_uint8_pixels(result.image[k]), text));
        }
      } catch (const std::exception& e) {
        out.failure = "encoding the images failed: " + error_message(e);
        continue;
      }
      out.kind = JobOutcome::Kind::Images;
      out.width = result.width;
      out.height = result.height;
      out.steps = result.num_inference_steps;
      for (const auto& note : result.notes) out.warnings.push_back(client_note(note));
      out.warnings.insert(out.warnings.end(), shared_warnings.begin(), shared_warnings.end());
    }
    return outcomes;
  }

  // Rank 0: answers the jobs of one generation from their outcomes (`seconds`: the generation's
  // time, counted once for the batch) and marks them finished.
  void answer(const std::vector<std::shared_ptr<Job>>& batch, const std::vector<JobOutcome>& outcomes,
              double seconds, int replica) {
    int64_t images = 0;
    for (const auto& outcome : outcomes) images += static_cast<int64_t>(outcome.pngs.size());
    if (batch.size() > 1) metrics.observe_batch(static_cast<int64_t>(batch.size()), images);
    bool loop_counted = false;
    for (size_t i = 0; i < batch.size(); ++i) {
      Job& job = *batch[i];
      const JobOutcome& outcome = outcomes[i];
      Reply reply;
      JobStatus status = JobStatus::Failed;
      std::string reason;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (job.cancel_asked.load()) reason = job.cancel_reason;
      }
      if (outcome.kind == JobOutcome::Kind::Cancelled || (outcome.kind == JobOutcome::Kind::Images && !reason.empty())) {
        reply = cancelled_reply(job, reason);
        status = JobStatus::Cancelled;
        metrics.count_cancelled(reason);
      } else if (outcome.kind == JobOutcome::Kind::Images) {
        try {
          reply = images_reply(job, outcome, static_cast<int64_t>(batch.size()), replica);
          status = JobStatus::Succeeded;
          // The batch's steps and time are counted once, with its first answered request.
          metrics.observe_generation(seconds_between(job.arrived, Clock::now()),
                                     static_cast<int64_t>(outcome.pngs.size()), loop_counted ? 0 : outcome.steps,
                                     loop_counted ? 0 : seconds);
          loop_counted = true;
          metrics.count_warnings(static_cast<int64_t>(outcome.warnings.size()));
        } catch (const std::exception& e) {
          reply = error_reply(ApiError(500, "writing the images failed: " + error_message(e)));
        }
      } else {
        reply = error_reply(ApiError(500, "the generation failed: " + outcome.failure));
      }
      std::lock_guard<std::mutex> lock(mutex);
      finish(batch[i], status, std::move(reply));
      running.erase(std::remove(running.begin(), running.end(), batch[i]), running.end());
      publish_queue();
    }
  }

  // Takes the next job and, with batching on, the queued jobs that share its batch key, waiting
  // up to --batch-wait for more while the batch has room (the caller holds the lock, released
  // while waiting). Each taken job is running.
  std::vector<std::shared_ptr<Job>> take_batch(std::unique_lock<std::mutex>& lock) {
    std::vector<std::shared_ptr<Job>> batch = {waiting.front()};
    waiting.pop_front();
    // Running from the moment it is taken: a cancel while the batch waits for more is then asked
    // of the generation, not answered twice.
    const auto start_running = [this](const std::shared_ptr<Job>& job) {
      job->status = JobStatus::Running;
      running.push_back(job);
    };
    start_running(batch.front());
    int64_t images = batch.front()->request.n;
    const std::string& key = batch.front()->batch_key;
    const auto deadline = Clock::now() + options.batch_wait;
    while (!key.empty() && images < options.max_batch) {
      for (auto it = waiting.begin(); it != waiting.end() && images < options.max_batch;) {
        if ((*it)->batch_key == key && images + (*it)->request.n <= options.max_batch) {
          images += (*it)->request.n;
          batch.push_back(*it);
          start_running(*it);
          it = waiting.erase(it);
        } else {
          ++it;
        }
      }
      if (images >= options.max_batch || Clock::now() >= deadline || g_stop_signal.load() != 0) break;
      wake.wait_until(lock, deadline);
    }
    publish_queue();
    return batch;
  }

  // The phase clients see (the caller holds the lock): a stop signal shows at once, before the
  // serving loop (perhaps inside a generation) notices it.
  Phase visible_phase() const {
    const bool stop_asked = g_stop_signal.load() != 0;
    return stop_asked && (phase == Phase::Loading || phase == Phase::Ready) ? Phase::Stopping : phase;
  }

  // Stops taking requests and answers every waiting one 503 (the caller holds the lock).
  void stop_accepting() {
    if (phase == Phase::Loading || phase == Phase::Ready) phase = Phase::Stopping;
    metrics.set_ready(false);
    fail_waiting(ApiError(503, "the server is shutting down"));
  }

  Reply health() {
    std::lock_guard<std::mutex> lock(mutex);
    static const char* names[] = {"loading", "ok", "stopping", "failed"};
    const Phase seen = visible_phase();
    json body = {{"status", names[static_cast<int>(seen)]},
                 {"model", options.model_id},
                 {"world_size", dist::World::get().size()},
                 {"queue", {{"waiting", waiting.size()}, {"capacity", options.queue_depth}, {"running", !running.empty()}}}};
    json ranks_json = json::array();
    for (const auto& r : all_ranks()) {
      ranks_json.push_back({{"rank", r.rank}, {"pid", r.pid}, {"resident_memory_bytes", r.rss_bytes},
                            {"peak_resident_memory_bytes", r.peak_rss_bytes}});
    }
    body["ranks"] = ranks_json;
    if (replicas > 1) {
      json replicas_json = json::array();
      for (int r = 0; r < replicas; ++r) {
        replicas_json.push_back({{"replica", r}, {"first_rank", r * replica_size}, {"ranks", replica_size},
                                 {"busy", static_cast<bool>(replica_busy[static_cast<size_t>(r)])}});
      }
      body["replicas"] = replicas_json;
    }
    if (!failure.empty()) body["error"] = failure;
    return {seen == Phase::Ready ? 200 : 503, body.dump()};
  }

  Reply models() {
    json model = {{"id", options.model_id}, {"object", "model"}, {"created", started}, {"owned_by", "shardit"}};
    json data = json::array({model});
    // The adapters as vLLM lists them (an entry whose parent is the base model), with the weight a
    // request gets without "lora"; a request names them in "lora".
    for (const auto& choice : options.limits.lora) {
      data.push_back({{"id", choice.name}, {"object", "model"}, {"created", started}, {"owned_by", "shardit"},
                      {"parent", options.model_id}, {"type", "lora"}, {"default_scale", choice.scale},
                      {"fused", options.fuse_lora}});
    }
    return {200, json{{"object", "list"}, {"data", data}}.dump()};
  }

  Reply job_status(const std::string& id) {
    std::lock_guard<std::mutex> lock(mutex);
    const auto found = jobs.find(id);
    if (found == jobs.end()) {
      return error_reply(ApiError(404, fmt::format("no job '{}' (finished jobs are kept until {} newer ones finish)",
                                                   id, options.jobs_kept)));
    }
    const Job& job = *found->second;
    json body = {{"id", job.id},
                 {"object", "image.generation.job"},
                 {"status", status_name(job.status)},
                 {"created", job.created},
                 {"step", job.step.load()},
                 {"num_inference_steps", job.steps.load()}};
    if (job.status == JobStatus::Queued) {
      const auto at = std::find(waiting.begin(), waiting.end(), found->second);
      body["queue_position"] = at - waiting.begin();
    }
    if (job.status == JobStatus::Cancelled) body["cancel_reason"] = job.cancel_reason;
    return {200, body.dump()};
  }

  Reply generations(const httplib::Request& request, const std::string& body, httplib::Response& response,
                    ImageEndpoint endpoint) {
    const pipelines::DiffusionPipeline* loaded = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (visible_phase() != Phase::Ready) return error_reply(unavailable());
      loaded = pipeline;
    }
    std::shared_ptr<Job> job = std::make_shared<Job>();
    job->id = request.get_header_value("X-Request-Id");
    if (request.has_header("X-Request-Id") && !is_plain_request_id(job->id)) {
      return error_reply(ApiError(400, "the header X-Request-Id must be 1 to 128 letters, digits or ._:- characters",
                                  "X-Request-Id"));
    }
    if (job->id.empty()) job->id = new_request_id();
    response.set_header("X-Request-Id", job->id);
    try {
      job->request = parse_image_request(body, options.limits, options.model_id, endpoint);
      if (loaded->takes_max_area() && job->request.width && job->request.height) {
        job->request.max_area = *job->request.width * *job->request.height;
      }
      check_with_pipeline(job->request, *loaded);
    } catch (const ApiError& error) {
      return error_reply(error);
    }
    job->arrived = Clock::now();
    job->created = std::time(nullptr);
    if (options.max_batch > 1 && job->request.n < options.max_batch) job->batch_key = job->request.batch_key();
    if (options.generation_timeout.count() > 0) job->deadline = job->arrived + options.generation_timeout;
    // The Host header goes into the answer's URLs: only a plain host[:port] is taken from it.
    const std::string host = request.get_header_value("Host");
    job->base_url = "http://" + (is_plain_host(host) ? host : options.host + ":" + std::to_string(options.port));
    std::future<Reply> reply = job->reply.get_future();
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (visible_phase() != Phase::Ready) return error_reply(unavailable());
      if (static_cast<int64_t>(waiting.size()) >= options.queue_depth) {
        return error_reply(ApiError(
            429, fmt::format("the queue is full ({} requests waiting behind the running one); retry later",
                             options.queue_depth)));
      }
      const auto same = jobs.find(job->id);
      if (same != jobs.end() &&
          (same->second->status == JobStatus::Queued || same->second->status == JobStatus::Running)) {
        return error_reply(ApiError(409, fmt::format("the X-Request-Id '{}' belongs to a job that is still {}; choose "
                                                     "another id", job->id, status_name(same->second->status)),
                                    "X-Request-Id"));
      }
      jobs[job->id] = job;
      waiting.push_back(job);
      publish_queue();
    }
    wake.notify_all();
    // A stop signal answers a request still in the queue at once (the launcher kills the ranks a
    // few seconds after forwarding it, and the running generation may take longer). A client that
    // closes its connection, or a request past --generation-timeout, is cancelled: at once while
    // queued, at the next step boundary while running.
    while (reply.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
      const bool gone = HttpServer::client_disconnected();
      const bool late = job->deadline && Clock::now() > *job->deadline;
      if (g_stop_signal.load() == 0 && !gone && !late) continue;
      std::lock_guard<std::mutex> lock(mutex);
      if (g_stop_signal.load() != 0) stop_accepting();
      if (gone || late) cancel(job, gone ? "disconnected" : "timeout");
    }
    return reply.get();
  }

  // The error for a request that cannot be served now (the caller holds the lock).
  ApiError unavailable() const {
    switch (visible_phase()) {
      case Phase::Loading: return ApiError(503, "the model is still loading; retry when GET /health answers 200");
      case Phase::Stopping: return ApiError(503, "the server is shutting down");
      default: return ApiError(503, "the server failed: " + failure);
    }
  }

  void route() {
    const auto send = [](httplib::Response& res, const Reply& reply, const char* type = "application/json") {
      res.status = reply.status;
      res.set_content(reply.body, type);
    };
    for (const auto& [path, endpoint] : {std::pair{"/v1/images/generations", ImageEndpoint::Generations},
                                         std::pair{"/v1/images/edits", ImageEndpoint::Edits}}) {
      const std::string route = path;
      http->post_with_body(route, [this, send, endpoint = endpoint](const httplib::Request& req, const std::string& body,
                                                                     httplib::Response& res) {
        send(res, generations(req, body, res, endpoint));
      });
      http->Get(route, [send, route](const httplib::Request&, httplib::Response& res) {
        send(res, error_reply(ApiError(405, "use POST for " + route)));
      });
    }
    http->Get("/v1/models", [this, send](const httplib::Request&, httplib::Response& res) { send(res, models()); });
    http->Get(R"(/v1/jobs/([A-Za-z0-9._:-]{1,128}))",
              [this, send](const httplib::Request& req, httplib::Response& res) {
                send(res, job_status(req.matches[1].str()));
              });
    http->Get("/health", [this, send](const httplib::Request&, httplib::Response& res) { send(res, health()); });
    http->Get("/metrics", [this, send](const httplib::Request&, httplib::Response& res) {
      send(res, {200, metrics.render()}, "text/plain; version=0.0.4");
    });
    http->Get(R"(/images/([A-Za-z0-9_-]+\.png))", [this, send](const httplib::Request& req, httplib::Response& res) {
      // Only regular files the folder holds itself: a symbolic link placed there (to /etc/passwd,
      // say) is never followed.
      constexpr uint64_t kMaxServedImageBytes = uint64_t{256} << 20;
      const std::string path = options.output_dir + "/" + req.matches[1].str();
      std::string bytes;
      try {
        if (!options.output_dir.empty()) bytes = io::read_regular_file(path, kMaxServedImageBytes, /*follow_links=*/false);
      } catch (const std::exception&) {
        bytes.clear();
      }
      if (bytes.empty()) {
        send(res, error_reply(ApiError(404, "no image " + req.matches[1].str())));
        return;
      }
      send(res, {200, bytes}, "image/png");
    });
    // Errors httplib answers itself (unknown path, body too large) get OpenAI's error body too.
    http->set_error_handler(httplib::Server::Handler([send](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      const int status = res.status;
      if (status == 404) {
        send(res, error_reply(ApiError(404, fmt::format("no route {} {}", req.method, req.path))));
      } else if (status == 413) {
        send(res, error_reply(ApiError(413, "the request body is too large")));
      } else {
        send(res, error_reply(ApiError(status, fmt::format("HTTP error {}", status))));
      }
    }));
    http->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      metrics.count_request(endpoint_of(req.path), res.status);
    });
  }

  // Every rank's last report, in rank order (the caller holds the lock).
  std::vector<RankReport> all_ranks() const {
    std::vector<RankReport> out;
    for (const auto& replica : ranks) out.insert(out.end(), replica.begin(), replica.end());
    return out;
  }

  // Keeps replica `replica`'s reports (for /health and /metrics).
  void set_ranks(int replica, std::vector<RankReport> reports) {
    std::lock_guard<std::mutex> lock(mutex);
    ranks[static_cast<size_t>(replica)] = std::move(reports);
    metrics.set_ranks(all_ranks());
  }

  // Replica `replica` starts or ends a generation (for /health and /metrics).
  void set_busy(int replica, bool busy) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      replica_busy[static_cast<size_t>(replica)] = busy;
    }
    metrics.set_replica_busy(replica, busy);
  }

  // A replica's first rank other than rank 0: runs on its replica the generations rank 0's
  // dispatcher posts to it (dist::World::post) and posts back their outcomes, reporting each
  // step and taking a cancellation at each step boundary. Between them it keeps its replica's
  // ranks in touch (a tick every --tick) and stops them when rank 0 says so. A failure is posted
  // for rank 0 before it is thrown.
  int serve_replica(pipelines::DiffusionPipeline& pipeline, ControlPlane& plane, int replica) {
    dist::World& world = dist::World::get();
    try {
      world.post(replica_key(replica, "ranks"), reports_json(plane.report(false)).dump());
      auto last_message = Clock::now();
      for (;;) {
        if (world.take(replica_key(replica, "stop"))) break;
        const std::optional<std::string> posted = world.take(replica_key(replica, "job"));
        if (!posted) {
          if (Clock::now() - last_message >= options.tick) {
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
            run_generation(pipeline, plane, requests, std::vector<JobLink>(requests.size(), link), &reports);
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

  // Rank 0's thread for replica `replica` (> 0): while the replica is free, hands it the next
  // queued jobs (a batch, as the serving loop takes them) and answers them from the outcomes it
  // posts back, passing their progress and cancellation along. It watches the replica's ranks'
  // heartbeats: a replica that fails or loses a rank fails the whole server (replica_failure,
  // which the serving loop turns into the server's failure; docs/serving.md says why).
  void dispatch(int replica) {
    dist::World& world = dist::World::get();
    std::vector<int> members(static_cast<size_t>(replica_size));
    std::iota(members.begin(), members.end(), replica * replica_size);
    std::vector<int64_t> beats = world.heartbeats(members);
    auto beats_read = Clock::now();
    // Throws when the replica posted a failure or one of its members' heartbeats stood still for
    // kHeartbeatSilence.
    const auto check_alive = [&] {
      if (const std::optional<std::string> failed = world.take(replica_key(replica, "failed"))) {
        TORCH_CHECK(false, *failed);
      }
      if (const std::optional<std::string> reports = world.take(replica_key(replica, "ranks"))) {
        set_ranks(replica, reports_from_json(json::parse(*reports)));
      }
      if (Clock::now() - beats_read < kHeartbeatSilence) return;
      const std::vector<int64_t> now = world.heartbeats(members);
      for (size_t i = 0; i < members.size(); ++i) {
        if (now[i] == beats[i]) {
          const std::string lost = world.lost_ranks(members);
          TORCH_CHECK(false, lost.empty() ? fmt::format("rank {} stopped beating", members[i]) : lost);
        }
      }
      beats = now;
      beats_read = Clock::now();
    };
    const auto failing = [this] {
      std::lock_guard<std::mutex> lock(mutex);
      return phase == Phase::Failed;
    };
    try {
      int64_t sequence = 0;
      for (;;) {
        std::vector<std::shared_ptr<Job>> batch;
        {
          std::unique_lock<std::mutex> lock(mutex);
          wake.wait_for(lock, std::chrono::milliseconds(100), [&] { return !waiting.empty() || stop_dispatch; });
          if (stop_dispatch || phase == Phase::Failed) break;
          if (!waiting.empty()) batch = take_batch(lock);
        }
        if (batch.empty()) {
          check_alive();
          continue;
        }
        set_busy(replica, true);
        json message = {{"sequence", ++sequence}, {"requests", json::array()}};
        for (const auto& job : batch) message["requests"].push_back(job->request.to_json());
        world.post(replica_key(replica, "job"), message.dump());
        bool cancel_posted = false;
        for (;;) {
          std::this_thread::sleep_for(kMailboxPoll);
          if (failing()) return;
          if (const std::optional<std::string> posted = world.take(replica_key(replica, "result"))) {
            const json result = json::parse(*posted);
            std::vector<JobOutcome> outcomes;
            for (const json& outcome : result.at("outcomes")) outcomes.push_back(JobOutcome::from_json(outcome));
            answer(batch, outcomes, result.at("seconds").get<double>(), replica);
            break;
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
          check_alive();
        }
        set_busy(replica, false);
      }
      if (failing()) return;
      world.post(replica_key(replica, "stop"), "1");
      while (!world.take(replica_key(replica, "stopped"))) {
        check_alive();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mutex);
      if (replica_failure.empty()) {
        replica_failure = fmt::format("replica {} (ranks {} to {}) failed: {}", replica, members.front(), members.back(),
                                      error_message(e));
      }
      wake.notify_all();
    }
  }

  // The answer to a finished generation: the PNGs as base64 or as files under output_dir.
  Reply images_reply(const Job& job, const JobOutcome& outcome, int64_t batch_requests, int replica) {
    json data = json::array();
    for (const std::string& png : outcome.pngs) {
      if (job.request.response_format == "url") {
        uint64_t index = 0;
        {
          std::lock_guard<std::mutex> lock(mutex);
          index = images_written++;
        }
        const std::string name = fmt::format("img-{}-{}-{}.png", started, index, job.request.seed);
        io::AtomicFile file(options.output_dir + "/" + name);
        file.write(png.data(), png.size());
        file.commit();
        data.push_back({{"url", job.base_url + "/images/" + name}});
      } else {
        data.push_back({{"b64_json", base64_encode(png)}});
      }
    }
    json body = {{"created", std::time(nullptr)},
                 {"data", data},
                 {"seed", job.request.seed},
                 {"size", fmt::format("{}x{}", outcome.width, outcome.height)},
                 {"num_inference_steps", outcome.steps},
                 {"id", job.id},
                 {"lora", lora_json(job.request.lora)},
                 // How many requests ran in the same denoising loop (serve --max-batch), and on
                 // which replica (serve --replicas).
                 {"batch_requests", batch_requests},
                 {"replica", replica},
                 // Where the request was not taken exactly as given (a prompt truncated, ...).
                 {"warnings", outcome.warnings}};
    return {200, body.dump()};
  }
};

Server::Server(ServeOptions options) : state_(std::make_unique<State>()) {
  TORCH_CHECK(options.queue_depth >= 1, "serve: --queue-depth must be at least 1, got ", options.queue_depth);
  TORCH_CHECK(options.max_batch >= 1 && options.max_batch <= 64, "serve: --max-batch must be 1 to 64 images, got ",
              options.max_batch);
  TORCH_CHECK(options.batch_wait.count() >= 0 && options.batch_wait <= std::chrono::milliseconds(1000),
              "serve: --batch-wait-ms must be 0 to 1000, got ", options.batch_wait.count());
  options.limits.url_output = !options.output_dir.empty();
  options.limits.lora.clear();
  for (const auto& file : options.lora) options.limits.lora.push_back({file.name, file.weight});
  options.limits.lora_fused = options.fuse_lora;
  state_->options = std::move(options);
}

Server::~Server() {
  if (state_->listening) {
    state_->http->stop_now();
    if (state_->listener.joinable()) state_->listener.join();
  }
}

int Server::listen() {
  if (dist::World::get().rank() != 0) return 0;
  State& s = *state_;
  ServeOptions& options = s.options;
  // Each connection has its own thread (up to the cap), so a full queue or slow clients never
  // block a health check.
  s.http = std::make_unique<HttpServer>(options.http, [](httplib::Response& res, int status, const std::string& message) {
    res.status = status;
    res.set_content(ApiError(status, message).body().dump(), "application/json");
  });
  // SO_REUSEADDR only: httplib's default SO_REUSEPORT would let a second server bind the same
  // port and silently take half of the requests.
  s.http->set_socket_options([](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  s.route();
  if (options.port == 0) {
    options.port = s.http->bind_to_any_port(options.host);
    TORCH_CHECK(options.port > 0, "serve: cannot listen on ", options.host, " (no free port, or not an address of "
                "this host)");
  } else {
    TORCH_CHECK(s.http->bind_to_port(options.host, options.port), "serve: cannot listen on ", options.host, ":",
                options.port, ": the port is in use or the address is not one of this host's; choose another --port "
                "or --host");
  }
  s.listening = true;
  s.listener = std::thread([&s] { s.http->listen_after_bind(); });
  return options.port;
}

int Server::run(pipelines::DiffusionPipeline& pipeline) {
  dist::World& world = dist::World::get();
  State& s = *state_;
  // Each replica of the mesh serves requests of its own (the pipeline's independent_replicas)
  // and has its own control plane; with one replica that is the world.
  const std::shared_ptr<dist::Group> replica_group = pipeline.replica_group() ? pipeline.replica_group() : world.group();
  ControlPlane plane(replica_group);
  s.replica_size = replica_group->size();
  s.replicas = world.size() / s.replica_size;
  s.replica_busy.assign(static_cast<size_t>(s.replicas), false);
  s.ranks.assign(static_cast<size_t>(s.replicas), {});
  s.metrics.set_replicas(s.replicas);
  const int replica = world.rank() / s.replica_size;
  // With batching on, every generation computes each image alone (a batch's and a lone
  // request's alike), so that an image never depends on the requests it ran beside.
  std::optional<nn::SamplewiseProducts> samplewise;
  if (s.options.max_batch > 1) samplewise.emplace();

  // The adapters, read once by every rank (each its slices) and then only switched per request.
  if (!s.options.lora.empty()) {
    models::load_lora_files(pipeline.lora_adapters(), s.options.lora, s.options.lora_scale, s.options.fuse_lora);
    const auto count = static_cast<int64_t>(s.options.lora.size());
    s.metrics.count_lora_loads(count, s.options.fuse_lora ? 0 : count);
    s.active_lora = lora_json(s.options.limits.lora).dump();  // load_lora_files made exactly them active
  }

  if (replica_group->rank() != 0) {
    plane.report(false);
    for (;;) {
      auto [kind, payload] = plane.receive();
      bool failed = false;
      if (kind == ControlKind::Generate || kind == ControlKind::GenerateBatch) {
        try {
          NoteCollector notes;  // rank 0 answers the notes; here they would only repeat in the log
          if (kind == ControlKind::Generate) {
            s.generate(pipeline, ImageRequest::from_json(json::parse(payload)), plane, nullptr);
          } else {
            std::vector<ImageRequest> requests;
            for (const json& request : json::parse(payload)) requests.push_back(ImageRequest::from_json(request));
            s.generate_batch(pipeline, requests, plane, {});
          }
        } catch (const GenerationCancelled&) {
          // rank 0 answers it
        } catch (const std::exception&) {
          failed = true;  // rank 0 names the failure; a lost rank fails the report below
        }
      }
      plane.report(failed);
      if (kind == ControlKind::Stop) return 0;
    }
  }
  if (replica != 0) return s.serve_replica(pipeline, plane, replica);

  // Rank 0: HTTP, the queue, replica 0's generations here and a dispatcher thread per other replica.
  std::vector<std::thread> dispatchers;
  const auto stop_dispatchers = [&] {
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.stop_dispatch = true;
    }
    s.wake.notify_all();
    for (std::thread& thread : dispatchers) thread.join();
    dispatchers.clear();
  };
  bool failed = false;  // fatal() ran: its error passes through the catch below unchanged
  const auto fatal = [&](const std::string& message) {
    failed = true;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.phase = Phase::Failed;
      s.failure = message;
      s.metrics.set_ready(false);
      for (const auto& job : s.running) {
        s.finish(job, JobStatus::Failed, error_reply(ApiError(500, "the generation failed: " + message)));
      }
      s.running.clear();
      s.fail_waiting(ApiError(503, "the server failed: " + message));
    }
    stop_dispatchers();
    std::this_thread::sleep_for(s.options.linger);
    s.http->stop_now();
    if (s.listener.joinable()) s.listener.join();
    s.listening = false;
    TORCH_CHECK(false, "serve: ", message);
  };

  try {
    {
      const auto reports = plane.report(false);
      s.set_ranks(0, reports);
      std::lock_guard<std::mutex> lock(s.mutex);
      s.pipeline = &pipeline;
      s.phase = Phase::Ready;
      s.metrics.set_ready(true);
      s.publish_queue();
    }
    for (int r = 1; r < s.replicas; ++r) dispatchers.emplace_back([&s, r] { s.dispatch(r); });
    const std::string layout =
        s.replicas > 1 ? fmt::format(" as {} replicas of {}", s.replicas, s.replica_size) : std::string();
    fmt::print("shardit serve: {} on {} rank(s){}; listening on http://{}:{}\n", s.options.model_id, world.size(),
               layout, s.options.host, s.options.port);
    std::fflush(stdout);
    auto last_message = Clock::now();
    for (;;) {
      std::vector<std::shared_ptr<Job>> batch;
      std::string replica_failure;
      {
        std::unique_lock<std::mutex> lock(s.mutex);
        s.wake.wait_for(lock, std::min<std::chrono::milliseconds>(s.options.tick, std::chrono::milliseconds(100)),
                        [&] { return !s.waiting.empty() || !s.replica_failure.empty(); });
        replica_failure = s.replica_failure;
        if (replica_failure.empty() && g_stop_signal.load() != 0) {
          s.stop_accepting();
          break;
        }
        if (replica_failure.empty() && !s.waiting.empty()) batch = s.take_batch(lock);
      }
      if (!replica_failure.empty()) fatal(replica_failure);
      if (batch.empty()) {
        if (Clock::now() - last_message < s.options.tick) continue;
        plane.send(ControlKind::Tick);
        const auto reports = plane.report(false);
        last_message = Clock::now();
        s.set_ranks(0, reports);
        continue;
      }

      std::vector<ImageRequest> requests;
      std::vector<JobLink> links;
      for (const auto& job : batch) {
        requests.push_back(job->request);
        links.push_back({[job](int64_t done, int64_t total) {
                           job->steps.store(total);
                           job->step.store(done);
                         },
                         [job] { return job->cancel_asked.load(); }});
      }
      s.set_busy(0, true);
      const auto start = Clock::now();
      std::vector<RankReport> reports;
      const std::vector<JobOutcome> outcomes = s.run_generation(pipeline, plane, requests, links, &reports);
      last_message = Clock::now();
      s.set_ranks(0, reports);
      s.answer(batch, outcomes, seconds_between(start, last_message), 0);
      s.set_busy(0, false);
    }
    // The other replicas finish their generations and stop their ranks; then this one's.
    stop_dispatchers();
    std::string replica_failure;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      replica_failure = s.replica_failure;
    }
    if (!replica_failure.empty()) fatal(replica_failure);
    plane.send(ControlKind::Stop);
    plane.report(false);
  } catch (const c10::Error& e) {
    if (failed) throw;
    fatal(error_message(e));
  }
  s.http->stop_now();
  if (s.listener.joinable()) s.listener.join();
  s.listening = false;
  return 0;
}

}  // namespace shardit::serving
