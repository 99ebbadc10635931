#include "shardit/serving/job_answers.h"

#include <fmt/format.h>

#include "shardit/core/error.h"
#include "shardit/io/file.h"
#include "shardit/serving/base64.h"

namespace shardit::serving {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

}  // namespace

JobAnswers::JobAnswers(const ServeOptions& options, Metrics& metrics, JobQueue& queue, time_t started)
    : options_(options), metrics_(metrics), queue_(queue), started_(started) {}

void JobAnswers::answer(const std::vector<std::shared_ptr<Job>>& batch, const std::vector<JobOutcome>& outcomes,
                        double seconds, int replica) {
  int64_t images = 0;
  for (const auto& outcome : outcomes) images += static_cast<int64_t>(outcome.images.size());
  if (batch.size() > 1) metrics_.observe_batch(static_cast<int64_t>(batch.size()), images);
  bool loop_counted = false;
  for (size_t i = 0; i < batch.size(); ++i) {
    Job& job = *batch[i];
    const JobOutcome& outcome = outcomes[i];
    Reply reply;
    JobStatus status = JobStatus::Failed;
    const std::string reason = queue_.cancel_reason(job);
    if (outcome.kind == JobOutcome::Kind::Cancelled || (outcome.kind == JobOutcome::Kind::Images && !reason.empty())) {
      reply = cancelled_reply(job, reason, options_.generation_timeout);
      status = JobStatus::Cancelled;
      metrics_.count_cancelled(reason);
    } else if (outcome.kind == JobOutcome::Kind::Images) {
      try {
        reply = images_reply(job, outcome, static_cast<int64_t>(batch.size()), replica);
        status = JobStatus::Succeeded;
        // The batch's steps and time are counted once, with its first answered request.
        metrics_.observe_generation(seconds_between(job.arrived, Clock::now()),
                                    static_cast<int64_t>(outcome.images.size()), loop_counted ? 0 : outcome.steps,
                                    loop_counted ? 0 : seconds);
        loop_counted = true;
        metrics_.count_warnings(static_cast<int64_t>(job.request.warnings.size() + outcome.warnings.size()));
      } catch (const std::exception& e) {
        reply = error_reply(ApiError(500, "writing the images failed: " + error_message(e)));
      }
    } else {
      reply = error_reply(ApiError(500, "the generation failed: " + outcome.failure));
    }
    queue_.complete(batch[i], status, std::move(reply));
  }
}

// The answer to a finished generation: the images (PNG or JPEG) as base64 or as files under output_dir.
Reply JobAnswers::images_reply(const Job& job, const JobOutcome& outcome, int64_t batch_requests, int replica) {
  json data = json::array();
  for (const std::string& image : outcome.images) {
    if (job.request.response_format == "url") {
      const uint64_t index = images_written_.fetch_add(1);
      const std::string name = fmt::format("img-{}-{}-{}.{}", started_, index, job.request.seed,
                                           job.request.file_extension());
      io::AtomicFile file(options_.output_dir + "/" + name);
      file.write(image.data(), image.size());
      file.commit();
      data.push_back({{"url", job.base_url + "/images/" + name}});
    } else {
      data.push_back({{"b64_json", base64_encode(image)}});
    }
  }
  // The request's own notes (OpenAI fields that change nothing here) before the generation's.
  std::vector<std::string> warnings = job.request.warnings;
  warnings.insert(warnings.end(), outcome.warnings.begin(), outcome.warnings.end());
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
               {"warnings", warnings}};
  return {200, body.dump()};
}

}  // namespace shardit::serving
