#pragma once
// The control plane of a served pipeline: a replica's first rank (rank 0 of its group; the world
// when there is one replica) tells the replica's other ranks what to do next over the replica's
// group (a header [kind, payload bytes] then the payload as uint8, both broadcast), and every
// message ends with an all-gather of each rank's status and memory, so that the first rank also
// learns of a lost rank while the server is idle. It sends at least one message every tick, so a
// waiting rank never reaches the collective timeout while the server has no work.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardit/dist/group.h"

namespace shardit::serving {

/// What rank 0 sends.
enum class ControlKind : int64_t {
  Tick = 0,      ///< no work: report status and memory
  Generate = 1,  ///< run the request in the payload (ImageRequest::to_json)
  Stop = 2,      ///< leave the serving loop
  GenerateBatch = 3,  ///< run the requests in the payload (a JSON array of ImageRequest::to_json) as one batch
};

/// One rank's report after a message.
struct RankReport {
  int rank = 0;
  int64_t pid = 0;
  int64_t rss_bytes = 0;       ///< resident memory now
  int64_t peak_rss_bytes = 0;  ///< the most resident memory so far
  int64_t failed = 0;          ///< 1 when the rank's last generation threw
};

/// This process's resident and peak resident memory in bytes (/proc/self/status; 0 where absent).
std::pair<int64_t, int64_t> resident_memory();

/// The control channel over `group` (the world): rank 0 sends, the others receive. Every call is
/// collective over the group. Errors are the group's c10::Error (naming the group, the operation
/// and the lost rank).
class ControlPlane {
 public:
  explicit ControlPlane(std::shared_ptr<dist::Group> group);
  /// Rank 0: sends `kind` with `payload` to every rank.
  void send(ControlKind kind, const std::string& payload = "");
  /// Other ranks: the next message (waits at most the group's timeout).
  std::pair<ControlKind, std::string> receive();
  /// At a step boundary of a generation (every rank after the same step): rank 0's `cancel`,
  /// the same on every rank, so that every rank stops at the same step and none is left waiting
  /// in a collective. The other ranks' `cancel` is ignored.
  bool step_boundary(bool cancel);
  /// Every rank's report (this rank's `failed` flag and memory), in rank order.
  std::vector<RankReport> report(bool failed);

 private:
  std::shared_ptr<dist::Group> group_;
};

}  // namespace shardit::serving
