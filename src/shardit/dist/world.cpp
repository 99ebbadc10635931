// The world: the rank's device and threads and, on a world of more than one rank, the rendezvous
// (rendezvous.h), a heartbeat per rank (heartbeat.h) that lets a failed collective name the rank
// that was lost, and the world group and sub-groups over c10d (process_group.h).
#include "shardit/dist/world.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#if SHARDIT_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <set>
#include <thread>

#include "shardit/core/error.h"
#include "shardit/dist/heartbeat.h"
#include "shardit/dist/process_group.h"
#include "shardit/dist/rank_list.h"
#include "shardit/dist/rendezvous.h"

namespace shardit::dist {

// Defined in group.cpp: a one-member group of a larger world.
std::shared_ptr<Group> make_single_group(int global_rank, std::string name);

namespace {

int timeout_override_ms() {
  const char* text = std::getenv("SHARDIT_DIST_TIMEOUT_MS");
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  TORCH_CHECK(end != text && *end == '\0' && value > 0 && value <= 24L * 3600 * 1000,
              "SHARDIT_DIST_TIMEOUT_MS='", text, "' is invalid: expected milliseconds, 1..86400000");
  return static_cast<int>(value);
}

at::Device choose_device(const std::string& device, int local_rank) {
  TORCH_CHECK(device == "auto" || device == "cpu" || device == "cuda", "device '", device,
              "' is not supported: use auto, cpu or cuda");
  const bool cuda = at::hasCUDA();
  TORCH_CHECK(device != "cuda" || cuda, "device 'cuda' was requested but this LibTorch has no "
              "usable CUDA device; use device auto or cpu");
  if (device == "cpu" || !cuda) return at::Device(at::kCPU);
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

// `options` with the timeout SHARDIT_DIST_TIMEOUT_MS sets, when it is set.
InitOptions with_timeout_override(InitOptions options) {
  if (const int override_ms = timeout_override_ms()) options.timeout = std::chrono::milliseconds(override_ms);
  return options;
}

// Intra-op CPU threads of this rank: `threads`, or when 0 the hardware cores shared among the
// host's ranks (at least 1).
int rank_threads(int threads, const LaunchEnv& env) {
  if (threads > 0) return threads;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, env.local_world_size));
}

World* g_world = nullptr;
std::mutex g_world_mutex;

}  // namespace

struct World::Impl {
  C10dTransport transport;  // no store on a world of one
  std::unique_ptr<Heartbeat> heartbeat;
  int groups_made = 0;
  int agreements = 0;
  std::mutex mailbox_mutex;  // post/take from several threads share the store's connection

  // The rendezvous: joins the store and picks the interface Gloo connects on.
  void join(const LaunchEnv& env, std::chrono::milliseconds timeout, at::Device device) {
    transport.timeout = timeout;
    transport.device = device;
    const std::string where = store_address(env);
    if (env.rank == 0) check_port_free(env.master_port);
    try {
      transport.store = join_store(env, timeout);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size, " (", launch_source_name(env.source),
                  "): rendezvous at ", where, " failed within ", timeout.count(), " ms: ", error_message(e),
                  env.rank == 0 ? std::string()
                                : "; check that all " + std::to_string(env.world_size) +
                                      " ranks were started with the same MASTER_ADDR/MASTER_PORT and that rank 0 is up");
    }
    try {
      GlooDevice gloo = make_gloo_device(env);
      transport.gloo_device = std::move(gloo.device);
      transport.gloo_address = std::move(gloo.address);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size, ": choosing the network interface for Gloo: ",
                  error_message(e));
    }
  }

  // After join: starts this rank's heartbeat and connects the group of all ranks. A failure to
  // connect names the lost ranks itself (connect_c10d_group).
  std::shared_ptr<Group> connect_world(const LaunchEnv& env) {
    std::vector<int> all(env.world_size);
    for (int r = 0; r < env.world_size; ++r) all[r] = r;
    try {
      heartbeat = Heartbeat::start(store_host(env), env.master_port, env.rank, transport.timeout);
      stop_heartbeat_at_exit();
      return connect_c10d_group("world", env.rank, all, "shardit/world", transport, lost_ranks_fn());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size,
                  ": setting up the world process group (rendezvous at ", store_address(env), ") failed within ",
                  transport.timeout.count(), " ms: ", error_message(e));
    }
  }

  LostRanksFn lost_ranks_fn() {
    Heartbeat* beat = heartbeat.get();
    if (beat == nullptr) return {};
    return [beat](const std::vector<int>& ranks) { return beat->lost_ranks(ranks); };
  }

  // The world is never destroyed, but the heartbeat thread touches the store on its own: it stops
  // at exit.
  static void stop_heartbeat_at_exit() {
    static std::once_flag stop_at_exit;
    std::call_once(stop_at_exit, [] {
      std::atexit([] {
        if (g_world != nullptr && g_world->impl_ && g_world->impl_->heartbeat) {
          g_world->impl_->heartbeat->stop();
        }
      });
    });
  }
};

World& World::init(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_world_mutex);
  if (g_world != nullptr) return *g_world;

  // Never destroyed: c10d's threads may still be blocked on a dead peer at exit. Only the
  // heartbeat thread is stopped (at exit), because it touches the store on its own.
  auto world = std::unique_ptr<World>(new World());
  world->env_ = LaunchEnv::from_environment();
  world->options_ = with_timeout_override(options);
  world->device_ = choose_device(world->options_.device, world->env_.local_rank);
  at::set_num_threads(rank_threads(world->options_.threads, world->env_));

#if SHARDIT_WITH_NCCL
  if (world->device_.is_cuda()) c10::cuda::set_device(world->device_.index());
#endif

  world->impl_ = std::make_shared<Impl>();
  if (world->env_.world_size == 1) {
    world->world_group_ = Group::single();
  } else {
    world->impl_->join(world->env_, world->options_.timeout, world->device_);
    world->world_group_ = world->impl_->connect_world(world->env_);
  }
  g_world = world.release();
  return *g_world;
}

World& World::get() {
  {
    std::lock_guard<std::mutex> lock(g_world_mutex);
    if (g_world != nullptr) return *g_world;
  }
  return init();
}

bool World::initialized() {
  std::lock_guard<std::mutex> lock(g_world_mutex);
  return g_world != nullptr;
}

void World::agree(const std::string& topic, const std::string& value) {
  if (size() == 1) return;
  const std::string prefix = "shardit/agree/" + std::to_string(impl_->agreements++) + "/";
  agree_through_store(*impl_->transport.store, prefix, rank(), size(), topic, value, options_.timeout);
}

std::shared_ptr<Group> World::new_group(const std::vector<int>& ranks) {
  TORCH_CHECK(!ranks.empty(), "new_group: the rank list is empty");
  std::set<int> seen;
  for (int r : ranks) {
    TORCH_CHECK(r >= 0 && r < size(), "new_group: rank ", r, " is out of range for a world of size ",
                size(), " (ranks [", list_ranks(ranks), "])");
    TORCH_CHECK(seen.insert(r).second, "new_group: rank ", r, " appears twice in [",
                list_ranks(ranks), "]");
  }
  // Every rank counts every call, members or not, so the store prefixes agree.
  const int index = impl_->groups_made++;
  const std::string name = "group" + std::to_string(index) + "[" + list_ranks(ranks) + "]";
  const auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  const int group_rank = static_cast<int>(it - ranks.begin());
  const int group_size = static_cast<int>(ranks.size());
  if (group_size == 1) return make_single_group(rank(), name);

  const std::string prefix = "shardit/group/" + std::to_string(index);
  try {
    return connect_c10d_group(name, group_rank, ranks, prefix, impl_->transport, impl_->lost_ranks_fn());
  } catch (const std::exception& e) {
    // connect_c10d_group's error names the lost members itself.
    TORCH_CHECK(false, "new_group ", name, " failed on rank ", rank(), " within ",
                options_.timeout.count(), " ms: ", error_message(e));
  }
}

void World::post(const std::string& key, const std::string& value) {
  TORCH_CHECK(impl_ && impl_->transport.store, "World::post: a world of one rank has no store");
  std::lock_guard<std::mutex> lock(impl_->mailbox_mutex);
  impl_->transport.store->set("shardit/mailbox/" + key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::optional<std::string> World::take(const std::string& key) {
  TORCH_CHECK(impl_ && impl_->transport.store, "World::take: a world of one rank has no store");
  const std::string full = "shardit/mailbox/" + key;
  std::lock_guard<std::mutex> lock(impl_->mailbox_mutex);
  if (!impl_->transport.store->check({full})) return std::nullopt;
  const std::vector<uint8_t> value = impl_->transport.store->get(full);
  impl_->transport.store->deleteKey(full);
  return std::string(value.begin(), value.end());
}

std::vector<int64_t> World::heartbeats(const std::vector<int>& ranks) {
  if (!impl_ || !impl_->heartbeat) return std::vector<int64_t>(ranks.size(), 0);
  return impl_->heartbeat->read(ranks);
}

std::string World::lost_ranks(const std::vector<int>& ranks) {
  if (!impl_ || !impl_->heartbeat) return "";
  return impl_->heartbeat->lost_ranks(ranks, "");
}

}  // namespace shardit::dist
