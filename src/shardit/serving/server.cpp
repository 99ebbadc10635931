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
#include <future>
#include <map>
#include <mutex>
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
  std::vector<RankReport> ranks;
  const pipelines::DiffusionPipeline* pipeline = nullptr;
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
                                     ControlPlane& plane, Job* job) {
    use_lora(pipeline, request.lora);
    pipelines::GenerateRequest call = request.to_generate();
    call.on_progress = [&plane, job](int64_t done, int64_t total) {
      if (job != nullptr) {
        job->steps.store(total);
        job->step.store(done);
      }
      if (done == 0) return;
      if (plane.step_boundary(job != nullptr && job->cancel_asked.load())) throw GenerationCancelled();
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
  // (`jobs`: rank 0's, one per request; empty elsewhere), which stops it there. A job cancelled
  // while others of its batch go on is answered when the batch ends.
  std::vector<std::optional<pipelines::GenerateResult>> generate_batch(pipelines::DiffusionPipeline& pipeline,
                                                                       const std::vector<ImageRequest>& requests,
                                                                       ControlPlane& plane,
                                                                       const std::vector<Job*>& jobs) {
    use_lora(pipeline, requests.front().lora);
    std::vector<pipelines::GenerateRequest> calls;
    for (const ImageRequest& request : requests) calls.push_back(request.to_generate());
    return pipeline.generate_batch(calls, [&](const std::vector<size_t>& members, int64_t done, int64_t total) {
      bool all_cancelled = !jobs.empty();
      for (const size_t i : members) {
        if (jobs.empty()) break;
        jobs[i]->steps.store(total);
        jobs[i]->step.store(done);
        all_cancelled = all_cancelled && jobs[i]->cancel_asked.load();
      }
      if (done == 0) return false;
      return plane.step_boundary(all_cancelled);
    });
  }

  // Takes the next job and, with batching on, the queued jobs that share its batch key, waiting
  // up to --batch-wait for more while the batch has room (the caller holds the lock, released
  // while waiting). Each taken job is running.
  std::vector<std::shared_ptr<Job>> take_batch(std::unique_lock<std::mutex>& lock) {
    std::vector<std::shared_ptr<Job>> batch = {waiting.front()};
    waiting.pop_front();
    int64_t images = batch.front()->request.n;
    const std::string& key = batch.front()->batch_key;
    const auto deadline = Clock::now() + options.batch_wait;
    while (!key.empty() && images < options.max_batch) {
      for (auto it = waiting.begin(); it != waiting.end() && images < options.max_batch;) {
        if ((*it)->batch_key == key && images + (*it)->request.n <= options.max_batch) {
          images += (*it)->request.n;
          batch.push_back(*it);
          it = waiting.erase(it);
        } else {
          ++it;
        }
      }
      if (images >= options.max_batch || Clock::now() >= deadline || g_stop_signal.load() != 0) break;
      wake.wait_until(lock, deadline);
    }
    for (const auto& job : batch) job->status = JobStatus::Running;
    running = batch;
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
    for (const auto& r : ranks) {
      ranks_json.push_back({{"rank", r.rank}, {"pid", r.pid}, {"resident_memory_bytes", r.rss_bytes},
                            {"peak_resident_memory_bytes", r.peak_rss_bytes}});
    }
    body["ranks"] = ranks_json;
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

  // The answer to a finished generation: the PNGs as base64 or as files under output_dir.
  Reply images_reply(const Job& job, const pipelines::GenerateResult& result,
                     const std::vector<std::string>& warnings, int64_t batch_requests) {
    json data = json::array();
    const std::vector<std::pair<std::string, std::string>> text = {
        {"prompt", job.request.prompt},
        {"seed", std::to_string(job.request.seed)},
        {"steps", std::to_string(result.num_inference_steps)},
        {"model", options.model_id},
        {"Software", "shardit"}};
    for (int64_t i = 0; i < result.image.size(0); ++i) {
      const at::Tensor pixels = io::to_uint8_pixels(result.image[i]);
      if (job.request.response_format == "url") {
        uint64_t index = 0;
        {
          std::lock_guard<std::mutex> lock(mutex);
          index = images_written++;
        }
        const std::string name = fmt::format("img-{}-{}-{}.png", started, index, job.request.seed);
        io::write_png(options.output_dir + "/" + name, pixels, text);
        data.push_back({{"url", job.base_url + "/images/" + name}});
      } else {
        data.push_back({{"b64_json", base64_encode(io::encode_png(pixels, text))}});
      }
    }
    json body = {{"created", std::time(nullptr)},
                 {"data", data},
                 {"seed", job.request.seed},
                 {"size", fmt::format("{}x{}", result.width, result.height)},
                 {"num_inference_steps", result.num_inference_steps},
                 {"id", job.id},
                 {"lora", lora_json(job.request.lora)},
                 // How many requests ran in the same denoising loop (serve --max-batch).
                 {"batch_requests", batch_requests},
                 // Where the request was not taken exactly as given (a prompt truncated, ...).
                 {"warnings", warnings}};
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
  ControlPlane plane(world.group());
  State& s = *state_;
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

  if (world.rank() != 0) {
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

  const auto fatal = [&](const std::string& message) {
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
    std::this_thread::sleep_for(s.options.linger);
    s.http->stop_now();
    if (s.listener.joinable()) s.listener.join();
    s.listening = false;
    TORCH_CHECK(false, "serve: ", message);
  };

  try {
    {
      const auto reports = plane.report(false);
      std::lock_guard<std::mutex> lock(s.mutex);
      s.ranks = reports;
      s.metrics.set_ranks(reports);
      s.pipeline = &pipeline;
      s.phase = Phase::Ready;
      s.metrics.set_ready(true);
      s.publish_queue();
    }
    fmt::print("shardit serve: {} on {} rank(s); listening on http://{}:{}\n", s.options.model_id, world.size(),
               s.options.host, s.options.port);
    std::fflush(stdout);
    auto last_message = Clock::now();
    for (;;) {
      std::vector<std::shared_ptr<Job>> batch;
      {
        std::unique_lock<std::mutex> lock(s.mutex);
        s.wake.wait_for(lock, std::min<std::chrono::milliseconds>(s.options.tick, std::chrono::milliseconds(100)),
                        [&] { return !s.waiting.empty(); });
        if (g_stop_signal.load() != 0) {
          s.stop_accepting();
          break;
        }
        if (!s.waiting.empty()) batch = s.take_batch(lock);
      }
      if (batch.empty()) {
        if (Clock::now() - last_message < s.options.tick) continue;
        plane.send(ControlKind::Tick);
        const auto reports = plane.report(false);
        last_message = Clock::now();
        std::lock_guard<std::mutex> lock(s.mutex);
        s.ranks = reports;
        s.metrics.set_ranks(reports);
        continue;
      }

      // One result per job: nullopt where the generation was cancelled.
      std::vector<std::optional<pipelines::GenerateResult>> results(batch.size());
      const auto start = Clock::now();
      std::string failure;
      std::vector<std::string> warnings;  // the notes of the shared run, for every job
      try {
        NoteCollector notes;
        if (batch.size() == 1) {
          plane.send(ControlKind::Generate, batch.front()->request.to_json().dump());
          try {
            results.front() = s.generate(pipeline, batch.front()->request, plane, batch.front().get());
          } catch (const GenerationCancelled&) {
          }
        } else {
          json requests = json::array();
          std::vector<ImageRequest> calls;
          std::vector<Job*> jobs;
          for (const auto& job : batch) {
            requests.push_back(job->request.to_json());
            calls.push_back(job->request);
            jobs.push_back(job.get());
          }
          plane.send(ControlKind::GenerateBatch, requests.dump());
          results = s.generate_batch(pipeline, calls, plane, jobs);
        }
        for (const auto& note : notes.notes()) warnings.push_back(client_note(note));
      } catch (const std::exception& e) {
        failure = error_message(e);
      }
      const auto end = Clock::now();
      const auto reports = plane.report(!failure.empty());
      last_message = Clock::now();
      for (const auto& r : reports) {
        if (failure.empty() && r.failed) failure = fmt::format("the generation failed on rank {}", r.rank);
      }
      int64_t images = 0;
      for (const auto& result : results) images += result ? result->image.size(0) : 0;
      if (batch.size() > 1) s.metrics.observe_batch(static_cast<int64_t>(batch.size()), images);
      bool loop_counted = false;
      for (size_t i = 0; i < batch.size(); ++i) {
        Job& job = *batch[i];
        Reply reply;
        JobStatus status = JobStatus::Failed;
        std::string reason;
        {
          std::lock_guard<std::mutex> lock(s.mutex);
          if (job.cancel_asked.load()) reason = job.cancel_reason;
        }
        if (failure.empty() && (!results[i] || !reason.empty())) {
          reply = s.cancelled_reply(job, reason);
          status = JobStatus::Cancelled;
          s.metrics.count_cancelled(reason);
        } else if (failure.empty()) {
          try {
            std::vector<std::string> job_warnings;
            for (const auto& note : results[i]->notes) job_warnings.push_back(client_note(note));
            job_warnings.insert(job_warnings.end(), warnings.begin(), warnings.end());
            reply = s.images_reply(job, *results[i], job_warnings, static_cast<int64_t>(batch.size()));
            status = JobStatus::Succeeded;
            // The batch's steps and time are counted once, with its first answered request.
            s.metrics.observe_generation(seconds_between(job.arrived, Clock::now()), results[i]->image.size(0),
                                         loop_counted ? 0 : results[i]->num_inference_steps,
                                         loop_counted ? 0 : seconds_between(start, end));
            loop_counted = true;
            s.metrics.count_warnings(static_cast<int64_t>(job_warnings.size()));
          } catch (const std::exception& e) {
            reply = error_reply(ApiError(500, "writing the images failed: " + error_message(e)));
          }
        } else {
          reply = error_reply(ApiError(500, "the generation failed: " + failure));
        }
        std::lock_guard<std::mutex> lock(s.mutex);
        s.finish(batch[i], status, std::move(reply));
      }
      std::lock_guard<std::mutex> lock(s.mutex);
      s.ranks = reports;
      s.metrics.set_ranks(reports);
      s.running.clear();
      s.publish_queue();
    }
    plane.send(ControlKind::Stop);
    plane.report(false);
  } catch (const c10::Error& e) {
    fatal(error_message(e));
  }
  s.http->stop_now();
  if (s.listener.joinable()) s.listener.join();
  s.listening = false;
  return 0;
}

}  // namespace shardit::serving
