#include "shardit/serving/server.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <httplib.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <ctime>
#include <optional>
#include <thread>

#include "shardit/core/error.h"
#include "shardit/core/heap.h"
#include "shardit/dist/launcher.h"
#include "shardit/dist/world.h"
#include "shardit/nn/linear.h"
#include "shardit/serving/generation.h"
#include "shardit/serving/job_answers.h"
#include "shardit/serving/job_queue.h"
#include "shardit/serving/replica_dispatch.h"
#include "shardit/serving/replica_status.h"
#include "shardit/serving/routes.h"

namespace shardit::serving {

namespace {

using Clock = std::chrono::steady_clock;

/// A job of rank 0's queue as the generation on replica 0 sees it.
JobLink link_to(const std::shared_ptr<Job>& job) {
  return {[job](int64_t done, int64_t total) {
            job->steps.store(total);
            job->step.store(done);
          },
          [job] { return job->cancel_asked.load(); }};
}

}  // namespace

namespace {

// SIGINT/SIGTERM: a stop, unless it is the launcher's notice that a rank failed.
void on_stop_signal(int signal, siginfo_t* info, void*) {
  if (dist::is_failure_notice(info)) {
    note_failure_notice(info->si_value.sival_int);
  } else {
    note_stop_signal(signal);
  }
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_sigaction = on_stop_signal;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
}

// The server's parts on rank 0 (the other ranks use only the options and the metrics): the queue,
// the replicas' state, the answers to finished generations, the dispatchers of replicas 1 and up,
// and the HTTP routes.
struct Server::State {
  explicit State(ServeOptions checked)
      : options(std::move(checked)),
        queue(options, metrics),
        replicas(metrics),
        answers(options, metrics, queue, started),
        dispatch(queue, replicas, answers),
        routes(options, metrics, queue, replicas, started) {}
  ~State() { stop_notice_watch(); }

  ServeOptions options;
  Metrics metrics;
  const time_t started = std::time(nullptr);
  JobQueue queue;
  ReplicaStatus replicas;
  JobAnswers answers;
  ReplicaDispatch dispatch;
  Routes routes;
  std::unique_ptr<HttpServer> http;  // rank 0 only, from listen()
  std::thread listener;
  bool listening = false;
  bool failed = false;  // fail() ran: its error passes through lead()'s catch unchanged
  std::atomic<bool> leading{false};
  std::thread notice_watch;  // rank 0, while it leads: the launcher's failure notice

  // Rank 0, while it leads: the launcher's word that a rank failed (the SIGTERM it stops the
  // other ranks with) fails the server at once, whatever rank 0 is doing: every open request is
  // answered naming the rank, and rank 0's loop wakes to exit.
  void watch_failure_notice() {
    while (leading.load()) {
      if (const std::optional<int> value = failure_notice()) {
        const dist::FailureNotice notice = dist::decode_failure_notice(*value);
        const std::string replica = replicas.replica_of(notice.rank);
        const std::string message = fmt::format("{}lost rank {} ({}, as the launcher reports)",
                                                replica.empty() ? "" : replica + " failed: ", notice.rank, notice.how());
        fmt::print(stderr, "shardit serve: {}; answering every open request and exiting\n", message);
        std::fflush(stderr);
        queue.report_replica_failure(message);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  void stop_notice_watch() {
    leading.store(false);
    if (notice_watch.joinable()) notice_watch.join();
  }

  // Rank 0: HTTP, the queue, replica 0's generations here and a dispatcher thread per other
  // replica, until a stop signal (returns 0) or a failure (throws).
  int lead(pipelines::DiffusionPipeline& pipeline, ReplicaGenerations& generations, ControlPlane& plane) {
    try {
      replicas.set_ranks(0, plane.report(false));
      queue.open(pipeline);
      leading.store(true);
      notice_watch = std::thread([this] { watch_failure_notice(); });
      dispatch.start();
      const int count = replicas.replicas();
      const std::string layout =
          count > 1 ? fmt::format(" as {} replicas of {}", count, replicas.replica_size()) : std::string();
      fmt::print("shardit serve: {} on {} rank(s){}; listening on http://{}:{}\n", options.model_id,
                 dist::World::get().size(), layout, options.host, options.port);
      std::fflush(stdout);
      serve_requests(generations, plane);
      // The other replicas finish their generations and stop their ranks; then this one's.
      dispatch.stop();
      const std::string replica_failure = queue.replica_failure();
      if (!replica_failure.empty()) fail(replica_failure);
      plane.send(ControlKind::Stop);
      plane.report(false);
    } catch (const c10::Error& e) {
      stop_notice_watch();
      if (failed) throw;
      fail(error_message(e));
    }
    stop_notice_watch();
    stop_http();
    return 0;
  }

  // Replica 0's generations on rank 0: the queued batches, one at a time, until a stop signal;
  // while idle a control message every --tick keeps the replica's ranks in touch. Another
  // replica's failure fails the server.
  void serve_requests(ReplicaGenerations& generations, ControlPlane& plane) {
    auto last_message = Clock::now();
    for (;;) {
      const Taken next =
          queue.next_for_rank0(std::min<std::chrono::milliseconds>(options.tick, std::chrono::milliseconds(100)));
      if (!next.replica_failure.empty()) fail(next.replica_failure);
      if (next.stop) return;
      if (next.batch.empty()) {
        if (Clock::now() - last_message < options.tick) continue;
        plane.send(ControlKind::Tick);
        const auto reports = plane.report(false);
        last_message = Clock::now();
        replicas.set_ranks(0, reports);
        continue;
      }
      std::vector<ImageRequest> requests;
      std::vector<JobLink> links;
      for (const auto& job : next.batch) {
        requests.push_back(job->request);
        job->forget_inputs();  // the generation reads its copy, freed before the answer
        links.push_back(link_to(job));
      }
      replicas.set_busy(0, true);
      const auto start = Clock::now();
      std::vector<RankReport> reports;
      const std::vector<JobOutcome> outcomes = generations.run(requests, links, &reports);
      last_message = Clock::now();
      replicas.set_ranks(0, reports);
      // The requests' images and the generation's activations are freed, their pages given back to
      // the OS (core/heap.h), before the clients hear: the server's RSS after an answer is what
      // it was before the request, give or take the answers' files. The replica is marked free
      // (its generation counted) before too, so the metrics a client reads after its answer
      // include its generation.
      std::vector<ImageRequest>().swap(requests);
      release_freed_memory();
      replicas.set_busy(0, false);
      answers.answer(next.batch, outcomes, seconds_between(start, last_message), 0);
    }
  }

  // The server failed with `message`: every open request is answered, /health reports the failure
  // for --linger, then HTTP stops and the error is thrown.
  void fail(const std::string& message) {
    failed = true;
    queue.fail(message);
    dispatch.stop();
    std::this_thread::sleep_for(options.linger);
    stop_http();
    TORCH_CHECK(false, "serve: ", message);
  }

  void stop_http() {
    http->stop_now();
    if (listener.joinable()) listener.join();
    listening = false;
  }
};

Server::Server(ServeOptions options) {
  TORCH_CHECK(options.queue_depth >= 1, "serve: --queue-depth must be at least 1, got ", options.queue_depth);
  TORCH_CHECK(options.max_batch >= 1 && options.max_batch <= 64, "serve: --max-batch must be 1 to 64 images, got ",
              options.max_batch);
  TORCH_CHECK(options.batch_wait.count() >= 0 && options.batch_wait <= std::chrono::milliseconds(1000),
              "serve: --batch-wait-ms must be 0 to 1000, got ", options.batch_wait.count());
  options.limits.url_output = !options.output_dir.empty();
  options.limits.lora.clear();
  for (const auto& adapter : options.lora) options.limits.lora.push_back({adapter.name, adapter.weight});
  options.limits.lora_fused = options.fuse_lora;
  state_ = std::make_unique<State>(std::move(options));
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
  s.routes.install(*s.http);
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
  s.replicas.set_layout(world.size() / replica_group->size(), replica_group->size());
  const int replica = world.rank() / replica_group->size();
  // With batching on, every generation computes each image alone (a batch's and a lone
  // request's alike), so that an image never depends on the requests it ran beside.
  std::optional<nn::SamplewiseProducts> samplewise;
  if (s.options.max_batch > 1) samplewise.emplace();

  // The adapters, read once by every rank (each its slices) with the pipeline's weights, and then
  // only switched per request.
  ReplicaGenerations generations(s.options, s.metrics, pipeline, plane);
  generations.adopt_loaded_lora();

  if (replica_group->rank() != 0) return generations.follow();
  if (replica != 0) return serve_replica(generations, plane, s.options.tick, replica);
  return s.lead(pipeline, generations, plane);
}

}  // namespace shardit::serving
