#include "shardit/serving/metrics.h"

#include <fmt/format.h>

namespace shardit::serving {

Metrics::Metrics() : bucket_bounds_{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600} {
  bucket_counts_.assign(bucket_bounds_.size(), 0);
}

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++requests_[{endpoint, status}];
}

void Metrics::observe_generation(double seconds, int64_t images, int64_t steps, double generation_seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < bucket_bounds_.size(); ++i) {
    if (seconds <= bucket_bounds_[i]) {
      ++bucket_counts_[i];
      break;
    }
  }
  ++latency_count_;
  latency_sum_ += seconds;
  images_ += static_cast<uint64_t>(images);
  steps_ += static_cast<uint64_t>(steps);
  generation_seconds_ += generation_seconds;
  if (generation_seconds > 0) last_steps_per_second_ = static_cast<double>(steps) / generation_seconds;
}

void Metrics::set_queue(int64_t waiting, int64_t capacity, bool running) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_ = waiting;
  capacity_ = capacity;
  running_ = running;
}

void Metrics::set_ranks(const std::vector<RankReport>& reports) {
  std::lock_guard<std::mutex> lock(mutex_);
  ranks_ = reports;
}

void Metrics::set_ready(bool ready) {
  std::lock_guard<std::mutex> lock(mutex_);
  ready_ = ready;
}

std::string Metrics::render() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string out;
  const auto header = [&out](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  header("shardit_ready", "gauge", "1 when the pipeline is loaded and every rank is serving");
  out += fmt::format("shardit_ready {}\n", ready_ ? 1 : 0);
  header("shardit_requests_total", "counter", "HTTP requests answered, by endpoint and status");
  for (const auto& [key, count] : requests_) {
    out += fmt::format("shardit_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, count);
  }
  header("shardit_queue_depth", "gauge", "generation requests waiting (not counting the running one)");
  out += fmt::format("shardit_queue_depth {}\n", waiting_);
  header("shardit_queue_capacity", "gauge", "generation requests that may wait before 429");
  out += fmt::format("shardit_queue_capacity {}\n", capacity_);
  header("shardit_generation_running", "gauge", "1 while a generation runs");
  out += fmt::format("shardit_generation_running {}\n", running_ ? 1 : 0);
  header("shardit_request_duration_seconds", "histogram",
         "time from arrival to answer of successful generation requests (queue wait included)");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bucket_bounds_.size(); ++i) {
    cumulative += bucket_counts_[i];
    out += fmt::format("shardit_request_duration_seconds_bucket{{le=\"{}\"}} {}\n", bucket_bounds_[i], cumulative);
  }
  out += fmt::format("shardit_request_duration_seconds_bucket{{le=\"+Inf\"}} {}\n", latency_count_);
  out += fmt::format("shardit_request_duration_seconds_sum {}\n", latency_sum_);
  out += fmt::format("shardit_request_duration_seconds_count {}\n", latency_count_);
  header("shardit_images_total", "counter", "images generated");
  out += fmt::format("shardit_images_total {}\n", images_);
  header("shardit_denoising_steps_total", "counter", "denoising steps run");
  out += fmt::format("shardit_denoising_steps_total {}\n", steps_);
  header("shardit_generation_seconds_total", "counter", "seconds spent generating (text encoding to decoded image)");
  out += fmt::format("shardit_generation_seconds_total {}\n", generation_seconds_);
  header("shardit_steps_per_second", "gauge", "denoising steps per second of the last generation");
  out += fmt::format("shardit_steps_per_second {}\n", last_steps_per_second_);
  header("shardit_rank_resident_memory_bytes", "gauge", "resident memory of each rank");
  for (const auto& rank : ranks_) {
    out += fmt::format("shardit_rank_resident_memory_bytes{{rank=\"{}\"}} {}\n", rank.rank, rank.rss_bytes);
  }
  header("shardit_rank_peak_resident_memory_bytes", "gauge", "peak resident memory of each rank");
  for (const auto& rank : ranks_) {
    out += fmt::format("shardit_rank_peak_resident_memory_bytes{{rank=\"{}\"}} {}\n", rank.rank, rank.peak_rss_bytes);
  }
  return out;
}

}  // namespace shardit::serving
