#pragma once
// `shardit serve`: an OpenAI-compatible images API over a tensor-parallel pipeline. Rank 0 answers
// HTTP (cpp-httplib) and keeps one bounded queue; each data-parallel replica of the mesh runs one
// generation at a time (a request, or a batch of compatible ones with max_batch), its ranks told
// what to run by its control plane (control.h); rank 0 runs replica 0's and hands the others
// theirs through the rendezvous store. Each request is a job (its id from
// X-Request-Id or drawn): GET /v1/jobs/{id} reports its step, and a client that disconnects (or
// --generation-timeout) cancels it at the next step boundary on every rank.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "shardit/pipelines/pipeline.h"
#include "shardit/serving/api.h"
#include "shardit/serving/http_server.h"

namespace shardit::serving {

struct ServeOptions {
  std::string host = "127.0.0.1";  ///< loopback unless told otherwise
  int port = 8000;                 ///< 0: any free port (printed)
  int64_t queue_depth = 16;        ///< requests that may wait behind the running one; more get 429
  std::string model_id;            ///< the `model` clients name (GET /v1/models)
  std::string output_dir;          ///< where response_format "url" writes images; empty: url not served
  RequestLimits limits;
  HttpLimits http;                 ///< body size, connections, request deadline
  /// The most time between two control messages while idle; keep well below the collective timeout.
  std::chrono::milliseconds tick{1000};
  /// How long /health reports a lost rank before the server exits.
  std::chrono::milliseconds linger{1000};
  /// The LoRA adapters of the pipeline (PipelineLoadOptions::lora, each named: the pipeline loads
  /// them, every rank its slices, once), unfused: each request chooses among them by name
  /// (ImageRequest::lora) without reloading; a request without "lora" gets all of them at their
  /// weights.
  std::vector<models::LoraRequest> lora;
  double lora_scale = 1.0;  ///< the runtime scale multiplying every adapter (--lora-scale)
  bool fuse_lora = false;   ///< merge them into the weights instead: no request may choose
  /// The most time from a generation request's arrival to its answer (queue wait included); a
  /// later one is cancelled at its next step boundary and answered 504. Zero: no limit.
  std::chrono::milliseconds generation_timeout{0};
  /// Dynamic batching: the most images one generation runs for queued requests that share their
  /// ImageRequest::batch_key (each request still gets exactly its own image, see
  /// DiffusionPipeline::generate_batch); 1: one request at a time.
  int64_t max_batch = 1;
  /// How long the first request of a batch waits for compatible ones to arrive while the batch
  /// holds fewer than max_batch images.
  std::chrono::milliseconds batch_wait{0};
  /// Finished jobs GET /v1/jobs/{id} still reports (the oldest are forgotten first).
  size_t jobs_kept = 256;
};

/// Installs SIGINT/SIGTERM handlers that ask the server to stop gracefully (on rank 0; the other
/// ranks keep serving until rank 0 tells them to stop). From the signal on, /health and every new
/// or queued request answer 503 at once; the running generation finishes.
void install_stop_handlers();

/// A served pipeline. Collective over the world: every rank constructs one and calls run().
class Server {
 public:
  explicit Server(ServeOptions options);
  ~Server();
  /// Rank 0: binds host:port and starts answering (GET /health is 503 "loading" until run());
  /// returns the bound port. Errors name the address. Other ranks: does nothing, returns 0.
  int listen();
  /// Serves until a stop is asked (SIGINT/SIGTERM on rank 0): returns 0 after finishing the
  /// running request and stopping every rank. Throws c10::Error naming the lost rank when a rank
  /// is lost (after answering every open request and reporting it on /health).
  int run(pipelines::DiffusionPipeline& pipeline);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shardit::serving
