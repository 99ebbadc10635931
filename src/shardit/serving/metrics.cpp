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

void Metrics::count_lora_loads(int64_t count, int64_t loaded) {
  std::lock_guard<std::mutex> lock(mutex_);
  lora_loads_ += static_cast<uint64_t>(count);
  lora_loaded_ = loaded;
}

void Metrics::observe_lora_switch(double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++lora_switches_;
  lora_switch_seconds_ += seconds;
}

void Metrics::count_cancelled(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++cancelled_[reason];
}

void Metrics::observe_batch(int64_t requests, int64_t images) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++batches_[requests];
  batched_images_ += static_cast<uint64_t>(images);
}

void Metrics::set_replicas(int count) {
  std::lock_guard<std::mutex> lock(mutex_);
  replica_busy_.assign(static_cast<size_t>(count), false);
  replica_generations_.assign(static_cast<size_t>(count), 0);
}

void Metrics::set_replica_busy(int replica, bool busy) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (replica < 0 || static_cast<size_t>(replica) >= replica_busy_.size()) return;
  if (replica_busy_[replica] && !busy) ++replica_generations_[replica];
  replica_busy_[replica] = busy;
}

void Metrics::count_warnings(int64_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  warnings_ += static_cast<uint64_t>(count);
}

std::string Metrics::render() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string out;
  const auto header = [&out](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  // A metric of one value, without labels.
  const auto scalar = [&out, &header](const char* name, const char* type, const char* help, const auto& value) {
    header(name, type, help);
    out += fmt::format("{} {}\n", name, value);
  };
  scalar("shardit_ready", "gauge", "1 when the pipeline is loaded and every rank is serving", ready_ ? 1 : 0);
  header("shardit_requests_total", "counter", "HTTP requests answered, by endpoint and status");
  for (const auto& [key, count] : requests_) {
    out += fmt::format("shardit_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, count);
  }
  scalar("shardit_queue_depth", "gauge", "generation requests waiting (not counting the running one)", waiting_);
  scalar("shardit_queue_capacity", "gauge", "generation requests that may wait before 429", capacity_);
  scalar("shardit_generation_running", "gauge", "1 while a generation runs", running_ ? 1 : 0);
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
  scalar("shardit_images_total", "counter", "images generated", images_);
  scalar("shardit_denoising_steps_total", "counter", "denoising steps run", steps_);
  scalar("shardit_generation_seconds_total", "counter", "seconds spent generating (text encoding to decoded image)",
         generation_seconds_);
  scalar("shardit_steps_per_second", "gauge", "denoising steps per second of the last generation",
         last_steps_per_second_);
  scalar("shardit_lora_loads_total", "counter",
         "LoRA adapters read from their files (at start only: choosing adapters per request reloads nothing)",
         lora_loads_);
  scalar("shardit_lora_adapters", "gauge", "LoRA adapters loaded", lora_loaded_);
  scalar("shardit_lora_switches_total", "counter", "changes of the active LoRA adapters between generations",
         lora_switches_);
  scalar("shardit_lora_switch_seconds_total", "counter", "seconds spent changing the active LoRA adapters",
         lora_switch_seconds_);
  header("shardit_cancelled_total", "counter",
         "generation requests cancelled (client disconnected, or --generation-timeout), by reason");
  for (const char* reason : {"disconnected", "timeout"}) {
    const auto found = cancelled_.find(reason);
    out += fmt::format("shardit_cancelled_total{{reason=\"{}\"}} {}\n", reason,
                       found == cancelled_.end() ? 0 : found->second);
  }
  header("shardit_batches_total", "counter",
         "generations that ran several requests as one batch (serve --max-batch), by their request count");
  for (const auto& [requests, count] : batches_) {
    out += fmt::format("shardit_batches_total{{requests=\"{}\"}} {}\n", requests, count);
  }
  scalar("shardit_batched_images_total", "counter", "images generated in batches of several requests",
         batched_images_);
  scalar("shardit_warnings_total", "counter", "warnings returned in answers (a prompt truncated, ...)", warnings_);
  header("shardit_replica_busy", "gauge", "1 while the replica runs a generation (serve --replicas)");
  for (size_t r = 0; r < replica_busy_.size(); ++r) {
    out += fmt::format("shardit_replica_busy{{replica=\"{}\"}} {}\n", r, replica_busy_[r] ? 1 : 0);
  }
  header("shardit_replica_generations_total", "counter", "generations each replica ran (a batch counts once)");
  for (size_t r = 0; r < replica_generations_.size(); ++r) {
    out += fmt::format("shardit_replica_generations_total{{replica=\"{}\"}} {}\n", r, replica_generations_[r]);
  }
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
