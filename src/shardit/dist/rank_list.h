#pragma once
// Rank lists in messages (internal to dist/): a failed collective, a missing or lost rank.
#include <string>
#include <vector>

namespace shardit::dist {

/// The ranks for a message: all of them when few, else the first and last few around a count, so
/// that a message stays one readable line (WORLD_SIZE=100000 would list 100000 missing ranks).
std::string list_ranks(const std::vector<int>& ranks);

}  // namespace shardit::dist
