#pragma once
// The HTTP endpoints of `shardit serve` (rank 0): POST /v1/images/generations and
// /v1/images/edits (a job queued, its answer awaited), GET /v1/models, /v1/jobs/{id}, /health,
// /metrics and /images/{name}, and OpenAI's error body for what httplib answers itself.
#include <ctime>
#include <future>
#include <memory>
#include <string>

#include "shardit/serving/http_server.h"
#include "shardit/serving/job_queue.h"
#include "shardit/serving/replica_status.h"

namespace shardit::serving {

class Routes {
 public:
  /// `options` (read at each request: listen() sets the bound port), `metrics`, `queue` and
  /// `replicas` outlive it; `started`: when the server started (GET /v1/models' "created").
  Routes(const ServeOptions& options, Metrics& metrics, JobQueue& queue, const ReplicaStatus& replicas,
         time_t started);

  /// Installs every endpoint on `http`.
  void install(HttpServer& http);

 private:
  Reply health() const;
  Reply models() const;
  Reply generations(const httplib::Request& request, const std::string& body, httplib::Response& response,
                    ImageEndpoint endpoint);
  Reply await_answer(const std::shared_ptr<Job>& job, std::future<Reply>& reply);
  Reply image_file(const std::string& name) const;

  const ServeOptions& options_;
  Metrics& metrics_;
  JobQueue& queue_;
  const ReplicaStatus& replicas_;
  const time_t started_;
};

}  // namespace shardit::serving
