#pragma once
// Generations on one replica of a served pipeline, collective over the replica's ranks: its first
// rank sends each request over the control plane (control.h) and runs it beside the others, which
// follow its messages; after every step the first rank tells every rank whether the generation
// is cancelled. What the first rank gets is each request's outcome, its images as PNG or JPEG files.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardit/serving/api.h"
#include "shardit/serving/control.h"
#include "shardit/serving/metrics.h"
#include "shardit/serving/server.h"

namespace shardit::serving {

/// How a generation reports a request's progress and learns that it is cancelled: bound to the
/// job on rank 0, to the dispatcher's mailbox on another replica's first rank; empty on the
/// ranks that only compute.
struct JobLink {
  std::function<void(int64_t done, int64_t total)> progress;
  std::function<bool()> cancelled;
};

/// What became of one request of a generation, as a replica's first rank hands it to rank 0:
/// its images as files in the request's output_format (PNG or JPEG), or why there are none.
struct JobOutcome {
  enum class Kind { Images, Cancelled, Failed };
  Kind kind = Kind::Failed;
  std::vector<std::string> images;
  int64_t width = 0;
  int64_t height = 0;
  int64_t steps = 0;
  std::vector<std::string> warnings;
  std::string failure;

  nlohmann::json to_json() const;
  static JobOutcome from_json(const nlohmann::json& in);
};

/// The generations of this rank's replica. Every rank of the replica makes one over the same
/// pipeline and the replica's control plane.
class ReplicaGenerations {
 public:
  /// `options`, `metrics`, `pipeline` and `plane` outlive it.
  ReplicaGenerations(const ServeOptions& options, Metrics& metrics, pipelines::DiffusionPipeline& pipeline,
                     ControlPlane& plane);

  /// Takes the LoRA adapters of ServeOptions::lora as the pipeline's load() left them (loaded and
  /// active at their weights, or fused) as the adapters active now, and counts them in the metrics.
  void adopt_loaded_lora();

  /// The replica's first rank: one generation (alone, or as a batch) of `requests`, each with its
  /// link, after the control message that makes the other ranks run it too, then every rank's
  /// report (into `reports`). Each request's outcome; a failed collective (a lost rank) throws.
  std::vector<JobOutcome> run(const std::vector<ImageRequest>& requests, const std::vector<JobLink>& links,
                              std::vector<RankReport>* reports);

  /// The replica's other ranks: run what the first rank sends and report after each message,
  /// until it says stop; returns 0. A lost rank throws (the group's c10::Error).
  int follow();

 private:
  pipelines::GenerateResult generate(const ImageRequest& request, const JobLink* link);
  std::vector<std::optional<pipelines::GenerateResult>> generate_batch(const std::vector<ImageRequest>& requests,
                                                                       const std::vector<JobLink>& links);
  void use_lora(const std::vector<LoraChoice>& lora);
  std::vector<JobOutcome> outcomes(const std::vector<ImageRequest>& requests, const std::vector<JobLink>& links,
                                   const std::vector<std::optional<pipelines::GenerateResult>>& results,
                                   const std::string& failure, const std::vector<std::string>& shared_warnings) const;

  const ServeOptions& options_;
  Metrics& metrics_;
  pipelines::DiffusionPipeline& pipeline_;
  ControlPlane& plane_;
  // The adapters active now on every rank (lora_json of what was set last); only use_lora changes it.
  std::string active_lora_;
};

}  // namespace shardit::serving
