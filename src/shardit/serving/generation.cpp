#include "shardit/serving/generation.h"

#include <fmt/format.h>

#include <exception>
#include <regex>

#include "shardit/core/error.h"
#include "shardit/core/heap.h"
#include "shardit/core/notes.h"
#include "shardit/io/png.h"
#include "shardit/serving/base64.h"

namespace shardit::serving {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

/// Thrown on every rank at the same step boundary when rank 0 cancels the running generation.
struct GenerationCancelled : std::exception {
  const char* what() const noexcept override { return "the generation was cancelled"; }
};

/// A note as a client may read it: the server's folders left out of every path it names
/// ("/srv/models/FLUX.1-dev/tokenizer_2: prompt has ..." -> "tokenizer_2: prompt has ...").
std::string client_note(const std::string& note) {
  static const std::regex path(R"((?:[^\s:'"/]*/)+([^\s:'"/]+))");
  return std::regex_replace(note, path, "$1");
}

}  // namespace

json JobOutcome::to_json() const {
  json encoded = json::array();
  for (const std::string& image : images) encoded.push_back(base64_encode(image));
  return {{"kind", static_cast<int>(kind)}, {"images", encoded}, {"width", width}, {"height", height},
          {"steps", steps}, {"warnings", warnings}, {"failure", failure}};
}

JobOutcome JobOutcome::from_json(const json& in) {
  JobOutcome out;
  out.kind = static_cast<Kind>(in.at("kind").get<int>());
  for (const auto& image : in.at("images")) out.images.push_back(base64_decode(image.get<std::string>()).value());
  out.width = in.at("width").get<int64_t>();
  out.height = in.at("height").get<int64_t>();
  out.steps = in.at("steps").get<int64_t>();
  out.warnings = in.at("warnings").get<std::vector<std::string>>();
  out.failure = in.at("failure").get<std::string>();
  return out;
}

ReplicaGenerations::ReplicaGenerations(const ServeOptions& options, Metrics& metrics,
                                       pipelines::DiffusionPipeline& pipeline, ControlPlane& plane)
    : options_(options), metrics_(metrics), pipeline_(pipeline), plane_(plane) {}

void ReplicaGenerations::adopt_loaded_lora() {
  if (options_.lora.empty()) return;
  const auto count = static_cast<int64_t>(options_.lora.size());
  metrics_.count_lora_loads(count, options_.fuse_lora ? 0 : count);
  active_lora_ = lora_json(options_.limits.lora).dump();  // the pipeline's load made exactly them active
}

std::vector<JobOutcome> ReplicaGenerations::run(const std::vector<ImageRequest>& requests,
                                                const std::vector<JobLink>& links, std::vector<RankReport>* reports) {
  std::vector<std::optional<pipelines::GenerateResult>> results(requests.size());
  std::string failure;
  std::vector<std::string> shared_warnings;  // the notes of the shared run, for every request
  try {
    NoteCollector notes;
    if (requests.size() == 1) {
      plane_.send(ControlKind::Generate, requests.front().to_json().dump());
      try {
        results.front() = generate(requests.front(), &links.front());
      } catch (const GenerationCancelled&) {
      }
    } else {
      json payload = json::array();
      for (const ImageRequest& request : requests) payload.push_back(request.to_json());
      plane_.send(ControlKind::GenerateBatch, payload.dump());
      results = generate_batch(requests, links);
    }
    for (const auto& note : notes.notes()) shared_warnings.push_back(client_note(note));
  } catch (const std::exception& e) {
    failure = error_message(e);
  }
  *reports = plane_.report(!failure.empty());
  for (const auto& r : *reports) {
    if (failure.empty() && r.failed) failure = fmt::format("the generation failed on rank {}", r.rank);
  }
  return outcomes(requests, links, results, failure, shared_warnings);
}

int ReplicaGenerations::follow() {
  plane_.report(false);
  for (;;) {
    auto [kind, payload] = plane_.receive();
    bool failed = false;
    if (kind == ControlKind::Generate || kind == ControlKind::GenerateBatch) {
      try {
        NoteCollector notes;  // rank 0 answers the notes; here they would only repeat in the log
        if (kind == ControlKind::Generate) {
          generate(ImageRequest::from_json(json::parse(payload)), nullptr);
        } else {
          std::vector<ImageRequest> requests;
          for (const json& request : json::parse(payload)) requests.push_back(ImageRequest::from_json(request));
          generate_batch(requests, {});
        }
      } catch (const GenerationCancelled&) {
        // rank 0 answers it
      } catch (const std::exception&) {
        failed = true;  // rank 0 names the failure; a lost rank fails the report below
      }
      release_freed_memory();  // the request's images and activations (core/heap.h)
    }
    plane_.report(failed);
    if (kind == ControlKind::Stop) return 0;
  }
}

// Runs `request` on this rank (collective: every rank calls it with the same request): its LoRA
// adapters (switched, never reloaded), then the pipeline, with a step boundary after every step
// at which rank 0 tells every rank whether the job of `link` (the first rank's; null elsewhere)
// is cancelled.
pipelines::GenerateResult ReplicaGenerations::generate(const ImageRequest& request, const JobLink* link) {
  use_lora(request.lora);
  pipelines::GenerateRequest call = request.to_generate();
  call.on_progress = [this, link](int64_t done, int64_t total) {
    if (link != nullptr) link->progress(done, total);
    if (done == 0) return;
    if (plane_.step_boundary(link != nullptr && link->cancelled())) throw GenerationCancelled();
  };
  return pipeline_.generate(call);
}

// Runs requests that share a batch key as one batch on this rank (collective like generate()):
// after each step rank 0 tells every rank whether every job of the running batch is cancelled
// (`links`: one per request on the replica's first rank; empty elsewhere), which stops it there.
// A job cancelled while others of its batch go on is answered when the batch ends.
std::vector<std::optional<pipelines::GenerateResult>> ReplicaGenerations::generate_batch(
    const std::vector<ImageRequest>& requests, const std::vector<JobLink>& links) {
  use_lora(requests.front().lora);
  std::vector<pipelines::GenerateRequest> calls;
  for (const ImageRequest& request : requests) calls.push_back(request.to_generate());
  return pipeline_.generate_batch(calls, [&](const std::vector<size_t>& members, int64_t done, int64_t total) {
    bool all_cancelled = !links.empty();
    for (const size_t i : members) {
      if (links.empty()) break;
      links[i].progress(done, total);
      all_cancelled = all_cancelled && links[i].cancelled();
    }
    if (done == 0) return false;
    return plane_.step_boundary(all_cancelled);
  });
}

// Makes `lora` the active adapters on this rank (collective: every rank switches alike).
void ReplicaGenerations::use_lora(const std::vector<LoraChoice>& lora) {
  if (options_.lora.empty() || options_.fuse_lora) return;
  const std::string wanted = lora_json(lora).dump();
  if (wanted == active_lora_) return;
  const auto start = Clock::now();
  std::vector<std::string> names;
  std::vector<double> weights;
  for (const auto& choice : lora) {
    names.push_back(choice.name);
    weights.push_back(choice.scale);
  }
  pipeline_.lora_adapters().set_adapters(names, weights);
  active_lora_ = wanted;
  metrics_.observe_lora_switch(seconds_between(start, Clock::now()));
}

// Each request's outcome from the generation's `results` (`failure`: why the generation failed;
// empty when it did not): its images encoded in the request's output_format with their notes and the run's
// `shared_warnings`, or cancelled, or failed.
std::vector<JobOutcome> ReplicaGenerations::outcomes(
    const std::vector<ImageRequest>& requests, const std::vector<JobLink>& links,
    const std::vector<std::optional<pipelines::GenerateResult>>& results, const std::string& failure,
    const std::vector<std::string>& shared_warnings) const {
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
          {"model", options_.model_id},
          {"Software", "shardit"}};
      for (int64_t k = 0; k < result.image.size(0); ++k) {
        out.images.push_back(requests[i].encode_image(io::to_uint8_pixels(result.image[k]), text));
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

}  // namespace shardit::serving
