#include "shardit/serving/control.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

namespace shardit::serving {

namespace {

// Payloads above this are a bug (a request body is at most 1 MiB): refused before sending.
constexpr int64_t kMaxPayload = 64 * 1024 * 1024;

int64_t status_kib(const std::string& text, const std::string& key) {
  const size_t at = text.find("\n" + key + ":");
  if (at == std::string::npos) return 0;
  std::istringstream line(text.substr(at + key.size() + 2));
  int64_t kib = 0;
  line >> kib;
  return kib;
}

}  // namespace

std::pair<int64_t, int64_t> resident_memory() {
  std::ifstream in("/proc/self/status");
  std::stringstream text;
  text << "\n" << in.rdbuf();
  return {status_kib(text.str(), "VmRSS") * 1024, status_kib(text.str(), "VmHWM") * 1024};
}

ControlPlane::ControlPlane(std::shared_ptr<dist::Group> group) : group_(std::move(group)) {
  TORCH_INTERNAL_ASSERT(group_ != nullptr);
}

void ControlPlane::send(ControlKind kind, const std::string& payload) {
  TORCH_INTERNAL_ASSERT(group_->rank() == 0, "only rank 0 sends control messages");
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(payload.size()) <= kMaxPayload);
  at::Tensor header = at::tensor({static_cast<int64_t>(kind), static_cast<int64_t>(payload.size())}, at::kLong);
  group_->broadcast(header, 0);
  if (payload.empty()) return;
  at::Tensor bytes = at::empty({static_cast<int64_t>(payload.size())}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>(), payload.data(), payload.size());
  group_->broadcast(bytes, 0);
}

std::pair<ControlKind, std::string> ControlPlane::receive() {
  at::Tensor header = at::zeros({2}, at::kLong);
  group_->broadcast(header, 0);
  const int64_t kind = header[0].item<int64_t>();
  const int64_t length = header[1].item<int64_t>();
  TORCH_CHECK(kind >= 0 && kind <= static_cast<int64_t>(ControlKind::GenerateBatch) && length >= 0 && length <= kMaxPayload, "control message from rank 0 is "
              "malformed (kind ", kind, ", ", length, " bytes): the ranks run different versions of shardit");
  std::string payload;
  if (length > 0) {
    at::Tensor bytes = at::empty({length}, at::kByte);
    group_->broadcast(bytes, 0);
    payload.assign(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(length));
  }
  return {static_cast<ControlKind>(kind), payload};
}

bool ControlPlane::step_boundary(bool cancel) {
  at::Tensor flag = at::tensor({static_cast<int64_t>(group_->rank() == 0 && cancel)}, at::kLong);
  group_->broadcast(flag, 0);
  return flag.item<int64_t>() != 0;
}

std::vector<RankReport> ControlPlane::report(bool failed) {
  const auto [rss, peak] = resident_memory();
  at::Tensor mine = at::tensor({static_cast<int64_t>(::getpid()), rss, peak, static_cast<int64_t>(failed)}, at::kLong)
                        .reshape({1, 4});
  const at::Tensor all = group_->all_gather(mine, 0);  // [ranks, 4]
  std::vector<RankReport> reports;
  for (int64_t r = 0; r < all.size(0); ++r) {
    RankReport report;
    report.rank = group_->global_ranks()[r];
    report.pid = all[r][0].item<int64_t>();
    report.rss_bytes = all[r][1].item<int64_t>();
    report.peak_rss_bytes = all[r][2].item<int64_t>();
    report.failed = all[r][3].item<int64_t>();
    reports.push_back(report);
  }
  return reports;
}

}  // namespace shardit::serving
