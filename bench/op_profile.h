#pragma once
// Operator-level profile for shardit-bench: every LibTorch operator (and every profiling scope)
// that runs while an OpProfile is alive is counted, with its self time and the bytes the CPU
// allocator handed out inside it. The same table as torch.profiler's key_averages() with
// profile_memory=True, so a forward can be compared op by op with diffusers' eager one.
#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace shardit_bench {

/// One operator's totals.
struct OpStats {
  int64_t calls = 0;
  double self_seconds = 0;
  int64_t allocations = 0;      ///< CPU allocator blocks handed out while it was the innermost op
  int64_t allocated_bytes = 0;  ///< their bytes
};

/// Counts operators from construction to destruction (or stop()), on every thread.
class OpProfile {
 public:
  OpProfile();
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  /// Stops counting; the totals stay readable.
  void stop();
  const std::map<std::string, OpStats>& ops() const;
  /// The allocator's high-water mark of live bytes while counting, over the live bytes at start.
  int64_t peak_bytes() const;
  /// A Markdown table sorted by self time (scope rows included), then the totals; divided by
  /// `steps` so the counts are per forward.
  std::string report(int steps) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shardit_bench
