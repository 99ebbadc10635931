#include "op_profile.h"

#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <vector>

#include "shardit/core/compat.h"

namespace shardit_bench {

namespace {

using Clock = std::chrono::steady_clock;

struct Frame {
  const char* name;
  Clock::time_point start;
  double child_seconds = 0;
};

thread_local std::vector<Frame> tls_stack;

struct Totals {
  std::mutex mutex;
  std::map<std::string, OpStats> ops;
  int64_t start_bytes = -1;
  int64_t peak_bytes = 0;
};

std::atomic<Totals*> active{nullptr};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  tls_stack.push_back({fn.name(), Clock::now()});
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (tls_stack.empty()) return;  // started before the profile
  const Frame frame = tls_stack.back();
  tls_stack.pop_back();
  const double total = std::chrono::duration<double>(Clock::now() - frame.start).count();
  if (!tls_stack.empty()) tls_stack.back().child_seconds += total;
  Totals* totals = active.load();
  if (totals == nullptr) return;
  std::lock_guard<std::mutex> lock(totals->mutex);
  OpStats& stats = totals->ops[fn.name()];
  ++stats.calls;
  stats.self_seconds += total - frame.child_seconds;
}

/// Receives the CPU allocator's reports (what torch.profiler's profile_memory uses).
class AllocationReporter : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, shardit::compat::MemoryReportTotal total_allocated_bytes,
                         shardit::compat::MemoryReportTotal /*total_reserved*/, c10::Device /*device*/) override {
    Totals* totals = active.load();
    if (totals == nullptr) return;
    const auto total_allocated = static_cast<int64_t>(total_allocated_bytes);
    std::lock_guard<std::mutex> lock(totals->mutex);
    if (totals->start_bytes < 0) totals->start_bytes = total_allocated - std::max<int64_t>(alloc_size, 0);
    totals->peak_bytes = std::max(totals->peak_bytes, total_allocated - totals->start_bytes);
    if (alloc_size <= 0) return;
    OpStats& stats = totals->ops[tls_stack.empty() ? "(outside any op)" : tls_stack.back().name];
    ++stats.allocations;
    stats.allocated_bytes += alloc_size;
  }
  bool memoryProfilingEnabled() const override { return true; }
};

}  // namespace

struct OpProfile::State {
  Totals totals;
  at::CallbackHandle handle = 0;
  std::unique_ptr<c10::DebugInfoGuard> memory_guard;
  bool running = false;
};

OpProfile::OpProfile() : state_(std::make_unique<State>()) {
  Totals* expected = nullptr;
  TORCH_CHECK(active.compare_exchange_strong(expected, &state_->totals), "OpProfile: one profile at a time");
  tls_stack.clear();
  state_->handle = at::addGlobalCallback(
      at::RecordFunctionCallback(on_start, on_end).scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
  state_->memory_guard = std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE,
                                                               std::make_shared<AllocationReporter>());
  state_->running = true;
}

OpProfile::~OpProfile() { stop(); }

void OpProfile::stop() {
  if (!state_->running) return;
  state_->running = false;
  state_->memory_guard.reset();
  at::removeCallback(state_->handle);
  active.store(nullptr);
}

const std::map<std::string, OpStats>& OpProfile::ops() const { return state_->totals.ops; }

int64_t OpProfile::peak_bytes() const { return state_->totals.peak_bytes; }

namespace {

// Operators that copy memory: what "extra copies" means in the comparison.
bool is_copy(const std::string& name) {
  return name == "aten::copy_" || name == "aten::cat" || name == "aten::clone" || name == "aten::contiguous" ||
         name == "aten::_to_copy" || name == "aten::stack" || name == "aten::repeat_interleave";
}

bool is_scope(const std::string& name) { return name.rfind("aten::", 0) != 0; }

}  // namespace

std::string OpProfile::report(int steps) const {
  std::vector<std::pair<std::string, OpStats>> rows(ops().begin(), ops().end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.self_seconds > b.second.self_seconds; });
  double self_total = 0;
  int64_t op_calls = 0, allocations = 0, bytes = 0, copy_calls = 0;
  for (const auto& [name, stats] : rows) {
    self_total += stats.self_seconds;
    allocations += stats.allocations;
    bytes += stats.allocated_bytes;
    if (is_scope(name)) continue;
    op_calls += stats.calls;
    if (is_copy(name)) copy_calls += stats.calls;
  }
  const double n = std::max(1, steps);
  std::string out = "| op | calls | self ms | self % | allocations | allocated MiB |\n|---|---|---|---|---|---|\n";
  char line[256];
  for (const auto& [name, stats] : rows) {
    if (stats.calls == 0 && stats.allocations == 0) continue;
    std::snprintf(line, sizeof(line), "| %s | %.0f | %.1f | %.1f%% | %.0f | %.1f |\n", name.c_str(), stats.calls / n,
                  stats.self_seconds * 1e3 / n, self_total > 0 ? 100.0 * stats.self_seconds / self_total : 0.0,
                  stats.allocations / n, static_cast<double>(stats.allocated_bytes) / n / (1 << 20));
    out += line;
  }
  std::snprintf(line, sizeof(line),
                "per forward: %.0f aten ops (%.0f copying), %.0f allocations, %.1f MiB allocated, allocator peak "
                "%.1f MiB over the start\n",
                op_calls / n, copy_calls / n, allocations / n, static_cast<double>(bytes) / n / (1 << 20),
                static_cast<double>(peak_bytes()) / (1 << 20));
  return out + line;
}

}  // namespace shardit_bench
