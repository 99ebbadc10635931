#include "shardit/core/profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace shardit::profile {

namespace {

struct Stat {
  int64_t calls = 0;
  double seconds = 0;
};

std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> flag{[] {
    const char* value = std::getenv("SHARDIT_PROFILE");
    return value != nullptr && std::strcmp(value, "0") != 0 && std::strcmp(value, "") != 0;
  }()};
  return flag;
}

std::mutex& stats_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<std::string, Stat>& stats() {
  static std::map<std::string, Stat> table;
  return table;
}

}  // namespace

void enable(bool on) { enabled_flag().store(on, std::memory_order_relaxed); }

bool enabled() { return enabled_flag().load(std::memory_order_relaxed); }

void reset() {
  std::lock_guard<std::mutex> lock(stats_mutex());
  stats().clear();
}

void add(const char* name, double seconds) {
  std::lock_guard<std::mutex> lock(stats_mutex());
  Stat& stat = stats()[name];
  ++stat.calls;
  stat.seconds += seconds;
}

std::string report() {
  std::vector<std::pair<std::string, Stat>> rows;
  {
    std::lock_guard<std::mutex> lock(stats_mutex());
    rows.assign(stats().begin(), stats().end());
  }
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  size_t width = 5;
  for (const auto& row : rows) width = std::max(width, row.first.size());
  // Scopes nest (a block contains its Linears), so shares are of the largest scope, not a sum.
  const double largest = rows.empty() ? 0.0 : rows.front().second.seconds;
  std::string out = fmt::format("{:<{}}  {:>8}  {:>12}  {:>10}  {:>7}\n", "scope", width, "calls", "total ms", "mean ms",
                                "share");
  for (const auto& [name, stat] : rows) {
    out += fmt::format("{:<{}}  {:>8}  {:>12.1f}  {:>10.3f}  {:>6.1f}%\n", name, width, stat.calls, stat.seconds * 1e3,
                       stat.seconds * 1e3 / static_cast<double>(stat.calls),
                       largest > 0 ? 100.0 * stat.seconds / largest : 0.0);
  }
  return out;
}

}  // namespace shardit::profile
