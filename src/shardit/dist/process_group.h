#pragma once
// Groups over c10d (internal to dist/): Gloo for CPU tensors, NCCL for CUDA tensors when LibTorch
// has it, connected through the rendezvous store.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardit/dist/group.h"
#include "shardit/dist/launch_env.h"

namespace gloo::transport {
class Device;
}

namespace shardit::dist {

/// A sentence naming the members of a group's `global_ranks` that were lost (Heartbeat::
/// lost_ranks), added to a failed collective's message; empty when nothing watches them.
using LostRanksFn = std::function<std::string(const std::vector<int>&)>;

/// What every c10d group of a world connects through.
struct C10dTransport {
  /// The rendezvous store; each group keeps its keys under a prefix of its own.
  c10::intrusive_ptr<c10d::Store> store;
  /// Gloo's network device (make_gloo_device).
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  /// Where that device listens and why, for messages (GlooDevice::address).
  std::string gloo_address;
  /// Collective timeout.
  std::chrono::milliseconds timeout{0};
  /// The rank's device: a CUDA one gives each group an NCCL backend (when LibTorch has NCCL).
  at::Device device{at::kCPU};
};

/// Gloo's device and, for messages, the address it listens on with the reason it was chosen
/// ("10.0.0.2 (interface eth1, the one that routes to MASTER_ADDR 10.0.0.1)").
struct GlooDevice {
  std::shared_ptr<::gloo::transport::Device> device;
  std::string address;
};

/// The interface Gloo listens and connects on: GLOO_SOCKET_IFNAME when set; loopback when every
/// rank is local (no MASTER_ADDR); else the address this host reaches MASTER_ADDR from (the local
/// end of a UDP socket connected to MASTER_ADDR:MASTER_PORT, which sends nothing), so a rank never
/// publishes a loopback address to other hosts because its host name resolves to one.
GlooDevice make_gloo_device(const LaunchEnv& env);

/// The group `name` of `global_ranks`, in which this process is member `rank`, with its c10d
/// state under `prefix` in the store. Returns once every member is connected. Collective over the
/// members. When Gloo cannot connect, the error names what it tried, the address every member
/// published, the members that failed to connect themselves (they post their error to the store)
/// or were lost, and GLOO_SOCKET_IFNAME.
std::shared_ptr<Group> connect_c10d_group(const std::string& name, int rank, const std::vector<int>& global_ranks,
                                          const std::string& prefix, const C10dTransport& transport,
                                          LostRanksFn lost_ranks);

}  // namespace shardit::dist
