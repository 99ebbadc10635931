#pragma once
// Profiling scopes: one per layer, so that a forward's time can be broken down by what ran.
// A scope also opens a LibTorch RECORD_FUNCTION range, so LibTorch's profiler sees the same names.
// Timing is off unless enabled (SHARDIT_PROFILE=1 in the environment, or profile::enable()); when
// off a scope costs one relaxed atomic load.
#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <string>

namespace shardit::profile {

/// Turns the per-scope accumulation on or off (the environment variable sets the start value).
void enable(bool on);
bool enabled();
/// Forgets everything accumulated so far.
void reset();
/// Scope name, calls, total and mean milliseconds, and share of the largest scope (scopes nest,
/// so shares do not add up), sorted by total time.
std::string report();

/// Adds one timed call to the scope `name`.
void add(const char* name, double seconds);

class Scope {
 public:
  explicit Scope(const char* name) : name_(name), timed_(enabled()) {
    if (timed_) start_ = std::chrono::steady_clock::now();
  }
  ~Scope() {
    if (timed_) add(name_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* name_;
  bool timed_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace shardit::profile

#define SHARDIT_PROFILE_CONCAT_INNER(a, b) a##b
#define SHARDIT_PROFILE_CONCAT(a, b) SHARDIT_PROFILE_CONCAT_INNER(a, b)
/// Times the rest of the enclosing block under `name` (a string literal).
#define SHARDIT_PROFILE_SCOPE(name)                                        \
  RECORD_FUNCTION(name, std::vector<c10::IValue>());                       \
  ::shardit::profile::Scope SHARDIT_PROFILE_CONCAT(shardit_profile_scope_, __LINE__)(name)
