#include "shardit/dist/rank_list.h"

#include <sstream>

namespace shardit::dist {

namespace {

std::string join_ranks(const std::vector<int>& ranks) {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

}  // namespace

std::string list_ranks(const std::vector<int>& ranks) {
  constexpr size_t kHead = 8, kTail = 2;
  if (ranks.size() <= kHead + kTail + 1) return join_ranks(ranks);
  const std::vector<int> head(ranks.begin(), ranks.begin() + kHead), tail(ranks.end() - kTail, ranks.end());
  return join_ranks(head) + ", ... (" + std::to_string(ranks.size() - kHead - kTail) + " more), " + join_ranks(tail);
}

}  // namespace shardit::dist
