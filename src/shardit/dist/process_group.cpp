// The c10d groups: collectives on Gloo (CPU tensors) and NCCL (CUDA tensors, when LibTorch has
// it), whose failures name the group, the op and the ranks that were lost.
#include "shardit/dist/process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#if SHARDIT_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "shardit/core/compat.h"
#include "shardit/core/error.h"
#include "shardit/core/profile.h"
#include "shardit/dist/rank_list.h"
#include "shardit/dist/rendezvous.h"

namespace shardit::dist {

namespace {

#if SHARDIT_C10D_HAS_BACKEND
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

// Sizes of what a rank sends, by the ring algorithms' count (see CommStats in group.h).
uint64_t tensor_bytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// The c10d tag of neighbour_exchange's messages (each pair of members exchanges in call order).
constexpr int kNeighbourTag = 16;

class C10dGroup final : public Group, public std::enable_shared_from_this<C10dGroup> {
 public:
  C10dGroup(std::string name, int rank, std::vector<int> global_ranks,
            c10::intrusive_ptr<C10dBackend> gloo, c10::intrusive_ptr<C10dBackend> nccl,
            LostRanksFn lost_ranks)
      : name_(std::move(name)),
        rank_(rank),
        global_ranks_(std::move(global_ranks)),
        gloo_(std::move(gloo)),
        nccl_(std::move(nccl)),
        lost_ranks_(std::move(lost_ranks)) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(global_ranks_.size()); }
  const std::vector<int>& global_ranks() const override { return global_ranks_; }
  const std::string& name() const override { return name_; }

  void all_reduce(at::Tensor& tensor) override {
    SHARDIT_PROFILE_SCOPE("all_reduce");
    all_reduce_async(tensor).wait();
  }

  Work all_reduce_async(at::Tensor& tensor) override {
    const int n = size();
    count("all_reduce", tensor_bytes(tensor) * 2 * (n - 1) / n);
    // Gloo sums half types without widening (and 1.13's Gloo has no bf16 at all): sum in f32 on
    // the wire and round once at the end, which also matches a single-rank f32 accumulation better.
    at::Tensor wire = tensor;
    if (!tensor.is_cuda() && (tensor.scalar_type() == at::kBFloat16 || tensor.scalar_type() == at::kHalf)) {
      wire = tensor.to(at::kFloat);
    } else if (!tensor.is_contiguous()) {
      wire = tensor.contiguous();
    }
    auto work = guarded("all_reduce", [&] {
      std::vector<at::Tensor> tensors{wire};
      return backend(tensor).allreduce(tensors);
    });
    auto self = shared_from_this();
    at::Tensor target = tensor;
    return Work([self, work, wire, target]() mutable {
      self->guarded("all_reduce", [&] { work->wait(); });
      if (!wire.is_same(target)) target.copy_(wire);
    });
  }

  at::Tensor all_gather(const at::Tensor& tensor, int64_t dim) override {
    SHARDIT_PROFILE_SCOPE("all_gather");
    dim = checked_dim(tensor, dim, "all_gather");
    const int n = size();
    count("all_gather", tensor_bytes(tensor) * (n - 1));
    const at::Tensor input = to_wire(tensor.contiguous());
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int i = 0; i < n; ++i) outputs[0].push_back(at::empty_like(input));
    guarded("all_gather", [&] {
      std::vector<at::Tensor> inputs{input};
      backend(tensor).allgather(outputs, inputs)->wait();
    });
    std::vector<at::Tensor> parts;
    for (auto& part : outputs[0]) parts.push_back(from_wire(part, tensor.scalar_type()));
    return at::cat(parts, dim);
  }

  at::Tensor reduce_scatter(const at::Tensor& tensor, int64_t dim) override {
    SHARDIT_PROFILE_SCOPE("reduce_scatter");
    dim = checked_dim(tensor, dim, "reduce_scatter");
    const int n = size();
    check_divisible(tensor, dim, "reduce_scatter");
    count("reduce_scatter", tensor_bytes(tensor) * (n - 1) / n);
    // Gloo has no reduce-scatter: exchange the chunks with one all-to-all (each member receives
    // every member's copy of its own chunk, (n-1)/n of the bytes, the same as a ring
    // reduce-scatter) and sum them locally in group order, widening half types to f32.
    const at::Tensor received = exchange_chunks(tensor, dim, "reduce_scatter");  // [n, chunk...]
    const bool narrow_type = tensor.scalar_type() == at::kBFloat16 || tensor.scalar_type() == at::kHalf;
    const at::Tensor summed = narrow_type ? received.to(at::kFloat).sum(0) : received.sum(0);
    return summed.to(tensor.scalar_type());
  }

  at::Tensor all_to_all(const at::Tensor& tensor, int64_t scatter_dim, int64_t gather_dim) override {
    SHARDIT_PROFILE_SCOPE("all_to_all");
    scatter_dim = checked_dim(tensor, scatter_dim, "all_to_all");
    gather_dim = checked_dim(tensor, gather_dim, "all_to_all");
    const int n = size();
    check_divisible(tensor, scatter_dim, "all_to_all");
    count("all_to_all", tensor_bytes(tensor) * (n - 1) / n);
    const at::Tensor received = exchange_chunks(tensor, scatter_dim, "all_to_all");
    return at::cat(received.unbind(0), gather_dim);
  }

  Work ring_shift_async(const at::Tensor& send, at::Tensor& recv) override {
    TORCH_CHECK(send.sizes() == recv.sizes() && send.scalar_type() == recv.scalar_type(), "ring_shift on group '",
                name_, "': recv ", recv.sizes(), " ", recv.scalar_type(), " does not match send ", send.sizes(), " ",
                send.scalar_type());
    TORCH_CHECK(send.device() == recv.device(), "ring_shift on group '", name_, "': send is on ", send.device(),
                " but recv on ", recv.device());
    const int n = size();
    count("ring_shift", tensor_bytes(send));
    // One all-to-all whose only non-empty splits are to the next member and from the previous
    // one: a single collective on Gloo and NCCL alike (paired send/recv calls could deadlock on
    // NCCL at n = 2, where next and previous are the same peer).
    at::Tensor input = to_wire(send.contiguous().view({-1}));
    at::Tensor output = to_wire(recv.is_contiguous() ? recv.view({-1}) : at::empty({recv.numel()}, recv.options()));
    std::vector<int64_t> input_splits(n, 0);
    std::vector<int64_t> output_splits(n, 0);
    input_splits[(rank_ + 1) % n] = send.numel();
    output_splits[(rank_ + n - 1) % n] = recv.numel();
    auto work = guarded("ring_shift", [&] {
      return backend(send).alltoall_base(output, input, output_splits, input_splits);
    });
    auto self = shared_from_this();
    at::Tensor target = recv;
    return Work([self, work, input, output, target]() mutable {
      self->guarded("ring_shift", [&] { work->wait(); });
      // `output` is a view of `target` unless it was not contiguous.
      if (output.data_ptr() != target.data_ptr()) target.copy_(from_wire(output, target.scalar_type()).view(target.sizes()));
    });
  }

  std::pair<at::Tensor, at::Tensor> neighbour_exchange(const at::Tensor& to_previous,
                                                       const at::Tensor& to_next) override {
    SHARDIT_PROFILE_SCOPE("neighbour_exchange");
    const bool has_previous = rank_ > 0;
    const bool has_next = rank_ + 1 < size();
    TORCH_CHECK((!has_previous || to_previous.defined()) && (!has_next || to_next.defined()),
                "neighbour_exchange on group '", name_, "': member ", rank_, " of ", size(),
                " has a neighbour but no tensor for it");
    const at::Tensor send_previous = has_previous ? to_wire(to_previous.contiguous()) : at::Tensor();
    const at::Tensor send_next = has_next ? to_wire(to_next.contiguous()) : at::Tensor();
    at::Tensor from_previous = has_previous ? at::empty_like(send_previous) : at::Tensor();
    at::Tensor from_next = has_next ? at::empty_like(send_next) : at::Tensor();
    count("neighbour_exchange",
          (has_previous ? tensor_bytes(send_previous) : 0) + (has_next ? tensor_bytes(send_next) : 0));
    if (!has_previous && !has_next) return {};
    C10dBackend& transport = backend(has_previous ? to_previous : to_next);
    // Every send and receive is posted before any is waited for, so no member waits on a
    // neighbour that is itself waiting (NCCL needs them in one group for that).
    guarded("neighbour_exchange", [&] {
      std::vector<decltype(transport.barrier())> pending;
      const auto post = [&](bool send, const at::Tensor& tensor, int peer) {
        std::vector<at::Tensor> tensors{tensor};
        pending.push_back(send ? transport.send(tensors, peer, kNeighbourTag) : transport.recv(tensors, peer, kNeighbourTag));
      };
#if SHARDIT_WITH_NCCL
      // CUDA tensors go to the NCCL backend (backend()). Its group calls are static in LibTorch
      // 1.x and members from 2.0 on; called on the object, the one line is both.
      const bool on_nccl = send_previous.defined() ? send_previous.is_cuda() : send_next.is_cuda();
      auto* nccl = on_nccl ? static_cast<c10d::ProcessGroupNCCL*>(&transport) : nullptr;
      if (nccl) nccl->groupStart();
#endif
      if (has_previous) {
        post(true, send_previous, rank_ - 1);
        post(false, from_previous, rank_ - 1);
      }
      if (has_next) {
        post(true, send_next, rank_ + 1);
        post(false, from_next, rank_ + 1);
      }
#if SHARDIT_WITH_NCCL
      if (nccl) nccl->groupEnd();
#endif
      for (auto& work : pending) work->wait();
    });
    return {has_previous ? from_wire(from_previous, to_previous.scalar_type()) : at::Tensor(),
            has_next ? from_wire(from_next, to_next.scalar_type()) : at::Tensor()};
  }

  void broadcast(at::Tensor& tensor, int root) override {
    SHARDIT_PROFILE_SCOPE("broadcast");
    const int n = size();
    TORCH_CHECK(root >= 0 && root < n, "broadcast on group '", name_, "': root ", root,
                " is out of range for a group of size ", n);
    count("broadcast", rank_ == root ? tensor_bytes(tensor) : 0);
    at::Tensor contiguous = tensor.contiguous();
    at::Tensor wire = to_wire(contiguous);
    guarded("broadcast", [&] {
      std::vector<at::Tensor> tensors{wire};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      backend(tensor).broadcast(tensors, options)->wait();
    });
    if (!contiguous.is_same(tensor)) tensor.copy_(contiguous);
  }

  void barrier() override {
    count("barrier", 0);
    guarded("barrier", [&] { gloo_->barrier()->wait(); });
  }

 private:
  template <typename Fn>
  auto guarded(const char* op, Fn&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const std::exception& e) {
      const std::string cause = error_message(e);
      const std::string lost = lost_ranks_ ? lost_ranks_(global_ranks_) : "";
      TORCH_CHECK(false, op, " on group '", name_, "' (global ranks ", list_ranks(global_ranks_),
                  ") failed on rank ", global_ranks_[rank_], ": ", cause,
                  lost.empty() ? "" : "; ", lost);
    }
  }

  void count(const char* op, uint64_t bytes) {
    ++stats_.collectives;
    ++stats_.calls_by_op[op];
    stats_.bytes_sent += bytes;
  }

  void check_divisible(const at::Tensor& tensor, int64_t dim, const char* op) const {
    TORCH_CHECK(tensor.size(dim) % size() == 0, op, " on group '", name_, "': dim ", dim,
                " of shape ", tensor.sizes(), " has size ", tensor.size(dim),
                ", which the group size ", size(), " does not divide");
  }

  C10dBackend& backend(const at::Tensor& tensor) {
    if (tensor.is_cuda()) {
      TORCH_CHECK(nccl_, "group '", name_, "' has no NCCL backend for a CUDA tensor; "
                  "LibTorch was built without NCCL, or the world was initialised with device=cpu");
      return *nccl_;
    }
    TORCH_CHECK(tensor.device().is_cpu(), "group '", name_, "': tensors on ", tensor.device(),
                " are not supported (only CPU, and CUDA with NCCL)");
    return *gloo_;
  }

  // Gloo moves only some types; data that is only moved (never summed) travels as a same-size type.
  static at::Tensor to_wire(const at::Tensor& t) {
    if (t.is_cuda()) return t;
    switch (t.scalar_type()) {
      case at::kBFloat16:
      case at::kShort: return t.view(at::kHalf);
      case at::kBool: return t.view(at::kByte);
      default: return t;
    }
  }
  static at::Tensor from_wire(const at::Tensor& t, at::ScalarType type) {
    return t.scalar_type() == type ? t : t.view(type);
  }

  // Splits `tensor` into size() chunks along `dim`, sends chunk j to member j; returns the received
  // chunks stacked in group order: [size, chunk shape].
  at::Tensor exchange_chunks(const at::Tensor& tensor, int64_t dim, const char* op) {
    at::Tensor input = to_wire(at::stack(tensor.chunk(size(), dim), 0).contiguous());
    at::Tensor output = at::empty_like(input);
    guarded(op, [&] {
      std::vector<int64_t> equal_splits;
      backend(tensor).alltoall_base(output, input, equal_splits, equal_splits)->wait();
    });
    return from_wire(output, tensor.scalar_type());
  }

  std::string name_;
  int rank_;
  std::vector<int> global_ranks_;
  c10::intrusive_ptr<C10dBackend> gloo_;
  c10::intrusive_ptr<C10dBackend> nccl_;
  LostRanksFn lost_ranks_;
};

c10::intrusive_ptr<C10dBackend> make_gloo(const std::string& prefix, int rank, int size, const C10dTransport& transport) {
  auto options = c10d::ProcessGroupGloo::Options::create(transport.timeout);
  options->devices.push_back(transport.gloo_device);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, transport.store);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options);
}

c10::intrusive_ptr<C10dBackend> make_nccl(const std::string& prefix, int rank, int size, const C10dTransport& transport) {
#if SHARDIT_WITH_NCCL
  if (transport.device.is_cuda()) {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = transport.timeout;
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix + "/nccl", transport.store);
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, options);
  }
#endif
  return {};
}

// The address a connection from this host to host:port leaves from: the local end of a UDP socket
// connect()ed there (a datagram socket's connect only picks the route; nothing is sent).
std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  TORCH_CHECK(resolved == 0 && found != nullptr, "MASTER_ADDR ", host, " does not resolve (", ::gai_strerror(resolved),
              ")");
  std::string error = "no address";
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {};
    const bool named = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
                       ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0 &&
                       ::inet_ntop(local.ss_family,
                                   local.ss_family == AF_INET6
                                       ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                                       : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr),
                                   text, sizeof(text)) != nullptr;
    if (!named) error = std::strerror(errno);
    ::close(fd);
    if (named) {
      ::freeaddrinfo(found);
      return text;
    }
  }
  ::freeaddrinfo(found);
  TORCH_CHECK(false, "this host has no route to MASTER_ADDR ", host, ":", port, " (", error,
              "); set GLOO_SOCKET_IFNAME to the network interface that reaches the other hosts");
}

// A field of Gloo's description of its device ("tcp, pci=, iface=eth0, speed=10000, addr=[10.0.0.2]").
std::string device_field(const std::string& text, const std::string& field) {
  const size_t at = text.find(field + "=");
  if (at == std::string::npos) return "";
  const size_t begin = at + field.size() + 1;
  const size_t end = text.find(',', begin);
  return text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

GlooDevice described(std::shared_ptr<::gloo::transport::Device> device, const std::string& why) {
  const std::string text = device->str();
  const std::string address = device_field(text, "addr");
  const std::string interface = device_field(text, "iface");
  return {std::move(device), (address.empty() ? text : address) + " (" +
                                 (interface.empty() ? "" : "interface " + interface + ", ") + why + ")"};
}

// The store keys of a group's connection: the address each member's Gloo device listens on, and
// the error of a member that could not connect.
std::string address_key(const std::string& prefix, int global_rank) {
  return prefix + "/gloo_address/" + std::to_string(global_rank);
}
std::string failure_key(const std::string& prefix, int global_rank) {
  return prefix + "/connect_failed/" + std::to_string(global_rank);
}

void store_set(c10d::Store& store, const std::string& key, const std::string& value) {
  try {
    store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
  } catch (const std::exception&) {
    // the store is gone with rank 0: the messages then do without this value
  }
}

// The value of `key`, "" when it is not (or no longer) in the store.
std::string store_value(c10d::Store& store, const std::string& key) {
  try {
    if (!store.check({key})) return "";
    const std::vector<uint8_t> value = store.get(key);
    return std::string(value.begin(), value.end());
  } catch (const std::exception&) {
    return "";
  }
}

bool is_loopback(const std::string& address) {
  return address.rfind("[127.", 0) == 0 || address.rfind("127.", 0) == 0 || address.rfind("[::1]", 0) == 0;
}

// Gloo could not connect this member (`rank` of `global_ranks`) to the others: `cause` (Gloo's
// words, with the address and port it tried), posted for the other members, and the whole story:
// every member's published address, the members that could not connect either (their own
// words), those lost, and the variable that chooses the interface.
[[noreturn]] void fail_to_connect(const std::string& name, int rank, const std::vector<int>& global_ranks,
                                  const std::string& prefix, c10d::Store& store, const LostRanksFn& lost_ranks,
                                  const std::string& cause, std::chrono::steady_clock::time_point others_deadline) {
  const int me = global_ranks[rank];
  // The addresses first, while the store is surely up: rank 0, which hosts it, may fail too and exit.
  std::vector<std::string> addresses;
  for (const int member : global_ranks) addresses.push_back(store_value(store, address_key(prefix, member)));
  store_set(store, failure_key(prefix, me), cause);
  // The others' own errors: a member that gave up says why (it may have exited since, which is then
  // its reason, not a crash). They are waited for until the others' own connection deadline
  // (`others_deadline`, at least a second). Rank 0 hosts the store: it stays a second more after
  // the last one posted, so that every member reads the others' words before the store goes.
  std::vector<std::string> failures(global_ranks.size());
  const auto deadline = std::max(others_deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1));
  std::optional<std::chrono::steady_clock::time_point> all_posted;
  for (;;) {
    bool all = true;
    for (size_t i = 0; i < global_ranks.size(); ++i) {
      if (global_ranks[i] == me || !failures[i].empty()) continue;
      failures[i] = store_value(store, failure_key(prefix, global_ranks[i]));
      all = all && !failures[i].empty();
    }
    const auto now = std::chrono::steady_clock::now();
    if (all && !all_posted) all_posted = now;
    if (all_posted && (me != 0 || now - *all_posted >= std::chrono::seconds(1))) break;
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::string text = "Gloo could not connect group '" + name + "' (global ranks " + list_ranks(global_ranks) +
                     ") on rank " + std::to_string(me) + ": " + cause +
                     "; each pair of ranks connects directly, to the address the other published:";
  for (size_t i = 0; i < global_ranks.size(); ++i) {
    text += (i == 0 ? " rank " : ", rank ") + std::to_string(global_ranks[i]) + " " +
            (addresses[i].empty() ? "(not known)" : addresses[i]);
  }
  std::vector<int> silent = {me};
  for (size_t i = 0; i < global_ranks.size(); ++i) {
    if (global_ranks[i] == me) continue;
    if (failures[i].empty()) {
      silent.push_back(global_ranks[i]);
    } else {
      text += "; rank " + std::to_string(global_ranks[i]) + " could not connect either: " + failures[i];
    }
  }
  const std::string lost = silent.size() > 1 && lost_ranks ? lost_ranks(silent) : "";
  if (!lost.empty()) text += "; " + lost;
  text += "; where a rank's address is not one the other hosts reach, set GLOO_SOCKET_IFNAME on every rank to the "
          "network interface that reaches them (`ip -brief address` lists a host's)";
  TORCH_CHECK(false, text);
}

}  // namespace

GlooDevice make_gloo_device(const LaunchEnv& env) {
  const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
  if (interface != nullptr && *interface != '\0') {
    std::shared_ptr<::gloo::transport::Device> device;
    try {
      device = c10d::ProcessGroupGloo::createDeviceForInterface(interface);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "GLOO_SOCKET_IFNAME=", interface, ": Gloo cannot listen on this interface: ",
                  error_message(e), "; set it to one network interface of this host that the other hosts reach "
                  "(`ip -brief address` lists them), or unset it to use the one that routes to MASTER_ADDR");
    }
    GlooDevice chosen = described(device, "from GLOO_SOCKET_IFNAME");
    // A loopback interface while MASTER_ADDR is reached over another one: no other host reaches it.
    if (is_loopback(chosen.address) && !env.master_addr.empty()) {
      try {
        const std::string route = local_address_towards(env.master_addr, env.master_port);
        if (!is_loopback(route)) {
          chosen.address.insert(chosen.address.size() - 1, "; loopback, which no other host reaches, while MASTER_ADDR " +
                                                                 env.master_addr + " is reached from " + route);
        }
      } catch (const std::exception&) {
        // no route to MASTER_ADDR: the store connection already told
      }
    }
    return chosen;
  }
  if (env.master_addr.empty()) {
    return described(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"), "loopback: every rank on this host");
  }
  const std::string local = local_address_towards(env.master_addr, env.master_port);
  return described(c10d::ProcessGroupGloo::createDeviceForHostname(local),
                   "the address that routes to MASTER_ADDR " + env.master_addr);
}

std::shared_ptr<Group> connect_c10d_group(const std::string& name, int rank, const std::vector<int>& global_ranks,
                                          const std::string& prefix, const C10dTransport& transport,
                                          LostRanksFn lost_ranks) {
  const int size = static_cast<int>(global_ranks.size());
  store_set(*transport.store, address_key(prefix, global_ranks[rank]), transport.gloo_address);
  c10::intrusive_ptr<C10dBackend> gloo;
  c10::intrusive_ptr<C10dBackend> nccl;
  const auto connect_limit = transport.timeout + std::chrono::seconds(2);
  const auto others_deadline = std::chrono::steady_clock::now() + connect_limit + std::chrono::seconds(1);
  try {
    // Gloo retries a refused connection well past its own timeout (50 s at a 10 s timeout): bounded.
    gloo = run_bounded<c10::intrusive_ptr<C10dBackend>>(
        connect_limit,
        [prefix, rank, size, transport] { return make_gloo(prefix, rank, size, transport); },
        "Gloo did not connect within " + std::to_string(transport.timeout.count()) +
            " ms (the timeout): a connection to another rank's address was refused or never answered");
    nccl = make_nccl(prefix, rank, size, transport);
  } catch (const std::exception& e) {
    fail_to_connect(name, rank, global_ranks, prefix, *transport.store, lost_ranks, error_message(e), others_deadline);
  }
  auto group = std::make_shared<C10dGroup>(name, rank, global_ranks, gloo, nccl, std::move(lost_ranks));
  // Constructing a Gloo group is not a synchronisation point: a member that finished connecting
  // may go on and drop the group while another is still connecting to it, which then fails with
  // "Connection closed by peer" (seen once in the suite; PyTorch's own Gloo tests flaked the same
  // way). After this barrier every member is connected (and no rank of the world exits before).
  group->barrier();
  return group;
}

}  // namespace shardit::dist
