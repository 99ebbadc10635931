#include "shardit/serving/routes.h"

#include <fmt/format.h>

#include <mutex>
#include <random>
#include <regex>

#include "shardit/dist/world.h"
#include "shardit/io/file.h"
#include "shardit/serving/multipart.h"

namespace shardit::serving {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

/// A Host header that is only a host name, IPv4 or [IPv6] address, with an optional port: what
/// may be echoed into a URL (anything else could inject text into the answer).
bool is_plain_host(const std::string& host) {
  static const std::regex plain(R"(^([A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])(:[0-9]{1,5})?$)");
  return std::regex_match(host, plain);
}

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

Routes::Routes(const ServeOptions& options, Metrics& metrics, JobQueue& queue, const ReplicaStatus& replicas,
               time_t started)
    : options_(options), metrics_(metrics), queue_(queue), replicas_(replicas), started_(started) {}

void Routes::install(HttpServer& http) {
  const auto send = [](httplib::Response& res, const Reply& reply, const char* type = "application/json") {
    res.status = reply.status;
    res.set_content(reply.body, type);
  };
  for (const auto& [path, endpoint] : {std::pair{"/v1/images/generations", ImageEndpoint::Generations},
                                       std::pair{"/v1/images/edits", ImageEndpoint::Edits}}) {
    const std::string route = path;
    http.post_with_body(route, [this, send, endpoint = endpoint](const httplib::Request& req, const std::string& body,
                                                                 httplib::Response& res) {
      send(res, generations(req, body, res, endpoint));
    }, /*takes_form=*/endpoint == ImageEndpoint::Edits);
    http.Get(route, [send, route](const httplib::Request&, httplib::Response& res) {
      send(res, error_reply(ApiError(405, "use POST for " + route)));
    });
  }
  http.Get("/v1/models", [this, send](const httplib::Request&, httplib::Response& res) { send(res, models()); });
  http.Get(R"(/v1/jobs/([A-Za-z0-9._:-]{1,128}))", [this, send](const httplib::Request& req, httplib::Response& res) {
    send(res, queue_.job_status(req.matches[1].str()));
  });
  http.Get("/health", [this, send](const httplib::Request&, httplib::Response& res) { send(res, health()); });
  http.Get("/metrics", [this, send](const httplib::Request&, httplib::Response& res) {
    send(res, {200, metrics_.render()}, "text/plain; version=0.0.4");
  });
  http.Get(R"(/images/([A-Za-z0-9_-]+\.(png|jpg)))", [this, send](const httplib::Request& req, httplib::Response& res) {
    const Reply reply = image_file(req.matches[1].str());
    const char* type = req.matches[2].str() == "jpg" ? "image/jpeg" : "image/png";
    send(res, reply, reply.status == 200 ? type : "application/json");
  });
  // Errors httplib answers itself (unknown path, body too large) get OpenAI's error body too.
  http.set_error_handler(httplib::Server::Handler([send](const httplib::Request& req, httplib::Response& res) {
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
  // Counted once the status is final and before the answer is written (httplib's logger runs
  // after): a client that has its answer reads metrics that count it.
  http.set_post_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    metrics_.count_request(endpoint_of(req.path), res.status);
  });
}

Reply Routes::health() const {
  static const char* names[] = {"loading", "ok", "stopping", "failed"};
  const QueueView queue = queue_.view();
  const ReplicasView replicas = replicas_.view();
  json body = {{"status", names[static_cast<int>(queue.phase)]},
               {"model", options_.model_id},
               {"world_size", dist::World::get().size()},
               {"queue", {{"waiting", queue.waiting}, {"capacity", options_.queue_depth}, {"running", queue.running}}}};
  json ranks_json = json::array();
  for (const auto& r : replicas.ranks) {
    ranks_json.push_back({{"rank", r.rank}, {"pid", r.pid}, {"resident_memory_bytes", r.rss_bytes},
                          {"peak_resident_memory_bytes", r.peak_rss_bytes}});
  }
  body["ranks"] = ranks_json;
  if (replicas.replicas > 1) {
    json replicas_json = json::array();
    for (int r = 0; r < replicas.replicas; ++r) {
      replicas_json.push_back({{"replica", r},
                               {"first_rank", r * replicas.replica_size},
                               {"ranks", replicas.replica_size},
                               {"busy", static_cast<bool>(replicas.busy[static_cast<size_t>(r)])}});
    }
    body["replicas"] = replicas_json;
  }
  if (!queue.failure.empty()) body["error"] = queue.failure;
  return {queue.phase == Phase::Ready ? 200 : 503, body.dump()};
}

Reply Routes::models() const {
  json model = {{"id", options_.model_id}, {"object", "model"}, {"created", started_}, {"owned_by", "shardit"}};
  json data = json::array({model});
  // The adapters as vLLM lists them (an entry whose parent is the base model), with the weight a
  // request gets without "lora"; a request names them in "lora".
  for (const auto& choice : options_.limits.lora) {
    data.push_back({{"id", choice.name}, {"object", "model"}, {"created", started_}, {"owned_by", "shardit"},
                    {"parent", options_.model_id}, {"type", "lora"}, {"default_scale", choice.scale},
                    {"fused", options_.fuse_lora}});
  }
  return {200, json{{"object", "list"}, {"data", data}}.dump()};
}

// A generation request: checked, queued as a job (its id from X-Request-Id or drawn), and
// answered once its generation ends.
Reply Routes::generations(const httplib::Request& request, const std::string& body, httplib::Response& response,
                          ImageEndpoint endpoint) {
  std::shared_ptr<Job> job = std::make_shared<Job>();
  std::future<Reply> reply = job->reply.get_future();
  try {
    const pipelines::DiffusionPipeline& loaded = queue_.pipeline();
    job->id = request.get_header_value("X-Request-Id");
    if (request.has_header("X-Request-Id") && !is_plain_request_id(job->id)) {
      throw ApiError(400, "the header X-Request-Id must be 1 to 128 letters, digits or ._:- characters",
                     "X-Request-Id");
    }
    if (job->id.empty()) job->id = new_request_id();
    response.set_header("X-Request-Id", job->id);
    // Edits come as JSON or, from OpenAI's clients, as a form (only edits take one:
    // check_request_head refuses a form elsewhere).
    const std::string content_type = request.get_header_value("Content-Type");
    job->request = is_form_data(content_type)
                       ? parse_image_form(parse_multipart(body, multipart_boundary(content_type)), options_.limits,
                                          options_.model_id)
                       : parse_image_request(body, options_.limits, options_.model_id, endpoint);
    if (loaded.max_area_is_output_area() && job->request.width && job->request.height) {
      job->request.max_area = *job->request.width * *job->request.height;
    }
    check_with_pipeline(job->request, loaded);
    job->reference_images = static_cast<int64_t>(job->request.images.size());
    job->arrived = Clock::now();
    job->created = std::time(nullptr);
    if (options_.max_batch > 1 && job->request.n < options_.max_batch) job->batch_key = job->request.batch_key();
    if (options_.generation_timeout.count() > 0) job->deadline = job->arrived + options_.generation_timeout;
    // The Host header goes into the answer's URLs: only a plain host[:port] is taken from it.
    const std::string host = request.get_header_value("Host");
    job->base_url = "http://" + (is_plain_host(host) ? host : options_.host + ":" + std::to_string(options_.port));
    queue_.submit(job);
  } catch (const ApiError& error) {
    return error_reply(error);
  }
  return await_answer(job, reply);
}

// A stop signal answers a request still in the queue at once (the launcher kills the ranks a few
// seconds after forwarding it, and the running generation may take longer). A client that closes
// its connection, or a request past --generation-timeout, is cancelled: at once while queued, at
// the next step boundary while running.
Reply Routes::await_answer(const std::shared_ptr<Job>& job, std::future<Reply>& reply) {
  while (reply.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
    const bool gone = HttpServer::client_disconnected();
    const bool late = job->deadline && Clock::now() > *job->deadline;
    if (!stop_asked() && !gone && !late) continue;
    queue_.stop_or_cancel(job, gone ? "disconnected" : late ? "timeout" : "");
  }
  return reply.get();
}

// GET /images/{name}: only regular files the output folder holds itself, so a symbolic link
// placed there (to /etc/passwd, say) is never followed.
Reply Routes::image_file(const std::string& name) const {
  constexpr uint64_t kMaxServedImageBytes = uint64_t{256} << 20;
  const std::string path = options_.output_dir + "/" + name;
  std::string bytes;
  try {
    if (!options_.output_dir.empty()) bytes = io::read_regular_file(path, kMaxServedImageBytes, /*follow_links=*/false);
  } catch (const std::exception&) {
    bytes.clear();
  }
  if (bytes.empty()) return error_reply(ApiError(404, "no image " + name));
  return {200, bytes};
}

}  // namespace shardit::serving
