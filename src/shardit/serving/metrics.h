#pragma once
// The server's counters, rendered in the Prometheus text exposition format (GET /metrics).
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "shardit/serving/control.h"

namespace shardit::serving {

/// The seconds from `a` to `b`, as the counters take durations.
inline double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

/// Thread-safe counters of a server.
class Metrics {
 public:
  Metrics();
  /// A finished HTTP request to `endpoint` ("generations", "models", ...) answered with `status`.
  void count_request(const std::string& endpoint, int status);
  /// A generation request answered 200 after `seconds` (queue wait included), with `images`
  /// images of `steps` denoising steps computed in `generation_seconds`.
  void observe_generation(double seconds, int64_t images, int64_t steps, double generation_seconds);
  void set_queue(int64_t waiting, int64_t capacity, bool running);
  void set_ranks(const std::vector<RankReport>& reports);
  void set_ready(bool ready);
  /// `count` LoRA adapters read from their files (onto every rank), `loaded` in all now.
  void count_lora_loads(int64_t count, int64_t loaded);
  /// A change of the active adapters between two generations, which took `seconds` (no reload).
  void observe_lora_switch(double seconds);
  /// A generation request cancelled before its answer: `reason` "disconnected" or "timeout".
  void count_cancelled(const std::string& reason);
  /// A generation that ran `requests` (> 1) requests with `images` images in all as one batch.
  void observe_batch(int64_t requests, int64_t images);
  /// The server's data-parallel replicas (serve --replicas): `count` of them, all idle.
  void set_replicas(int count);
  /// Replica `replica` starts (busy) or ends a generation; an end counts one.
  void set_replica_busy(int replica, bool busy);
  /// A generation answered with `count` warnings.
  void count_warnings(int64_t count);
  /// Prometheus text format, version 0.0.4.
  std::string render() const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  std::vector<double> bucket_bounds_;
  std::vector<uint64_t> bucket_counts_;  ///< per bound, not cumulative
  uint64_t latency_count_ = 0;
  double latency_sum_ = 0;
  uint64_t images_ = 0;
  uint64_t steps_ = 0;
  double generation_seconds_ = 0;
  double last_steps_per_second_ = 0;
  int64_t waiting_ = 0;
  int64_t capacity_ = 0;
  bool running_ = false;
  bool ready_ = false;
  std::vector<RankReport> ranks_;
  uint64_t lora_loads_ = 0;
  int64_t lora_loaded_ = 0;
  uint64_t lora_switches_ = 0;
  double lora_switch_seconds_ = 0;
  std::map<std::string, uint64_t> cancelled_;
  uint64_t warnings_ = 0;
  std::vector<bool> replica_busy_;
  std::vector<uint64_t> replica_generations_;
  std::map<int64_t, uint64_t> batches_;  ///< batches by their request count
  uint64_t batched_images_ = 0;
};

}  // namespace shardit::serving
