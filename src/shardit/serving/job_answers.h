#pragma once
// Rank 0's answers to the jobs of a finished generation, from the outcomes its replica reports:
// OpenAI's images response (each PNG as base64, or as a file under the output folder and its URL),
// a cancellation, or the failure; and the generation's metrics.
#include <atomic>
#include <cstdint>
#include <ctime>
#include <memory>
#include <vector>

#include "shardit/serving/generation.h"
#include "shardit/serving/job_queue.h"

namespace shardit::serving {

class JobAnswers {
 public:
  /// `options`, `metrics` and `queue` outlive it; `started`: when the server started (in the
  /// names of the image files it writes).
  JobAnswers(const ServeOptions& options, Metrics& metrics, JobQueue& queue, time_t started);

  /// Answers the jobs of one generation from their outcomes (`seconds`: the generation's time,
  /// counted once for the batch; `replica`: the replica that ran it) and marks them finished.
  void answer(const std::vector<std::shared_ptr<Job>>& batch, const std::vector<JobOutcome>& outcomes, double seconds,
              int replica);

 private:
  Reply images_reply(const Job& job, const JobOutcome& outcome, int64_t batch_requests, int replica);

  const ServeOptions& options_;
  Metrics& metrics_;
  JobQueue& queue_;
  const time_t started_;
  std::atomic<uint64_t> images_written_{0};
};

}  // namespace shardit::serving
