// The c10d groups: collectives on Gloo (CPU tensors) and NCCL (CUDA tensors, when LibTorch has
// it), whose failures name the group, the op and the ranks that were lost.
#include "shardit/dist/process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#if SHARDIT_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdlib>
#include <utility>

#include "shardit/core/compat.h"
#include "shardit/core/error.h"
#include "shardit/core/profile.h"
#include "shardit/dist/rank_list.h"

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
      const bool nccl = send_previous.defined() ? send_previous.is_cuda() : send_next.is_cuda();
      if (nccl) c10d::ProcessGroupNCCL::groupStart();
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
      if (nccl) c10d::ProcessGroupNCCL::groupEnd();
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

}  // namespace

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const LaunchEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (env.master_addr.empty()) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

std::shared_ptr<Group> connect_c10d_group(const std::string& name, int rank, const std::vector<int>& global_ranks,
                                          const std::string& prefix, const C10dTransport& transport,
                                          LostRanksFn lost_ranks) {
  const int size = static_cast<int>(global_ranks.size());
  auto gloo = make_gloo(prefix, rank, size, transport);
  auto nccl = make_nccl(prefix, rank, size, transport);
  auto group = std::make_shared<C10dGroup>(name, rank, global_ranks, gloo, nccl, std::move(lost_ranks));
  // Constructing a Gloo group is not a synchronisation point: a member that finished connecting
  // may go on and drop the group while another is still connecting to it, which then fails with
  // "Connection closed by peer" (seen once in the suite; PyTorch's own Gloo tests flaked the same
  // way). After this barrier every member is connected (and no rank of the world exits before).
  group->barrier();
  return group;
}

}  // namespace shardit::dist
