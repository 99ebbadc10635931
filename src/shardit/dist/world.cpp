// The world: rendezvous through a TCPStore, process groups over c10d (Gloo for CPU tensors, NCCL
// for CUDA tensors when LibTorch has it), and a heartbeat that lets a failed collective name the
// rank that was lost.
#include "shardit/dist/world.h"
#include "shardit/core/profile.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if SHARDIT_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <set>
#include <stdexcept>
#include <sstream>
#include <thread>

#include "shardit/core/compat.h"
#include "shardit/core/error.h"

namespace shardit::dist {

// Defined in group.cpp: a one-member group of a larger world.
std::shared_ptr<Group> make_single_group(int global_rank, std::string name);

namespace {

#if SHARDIT_C10D_HAS_BACKEND
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

// How often each rank bumps its heartbeat counter in the store, and how long a failed collective
// watches the counters before it calls a rank lost.
constexpr auto kHeartbeatPeriod = std::chrono::milliseconds(200);
constexpr auto kProbeWindow = std::chrono::milliseconds(1000);

std::string heartbeat_key(int rank) { return "shardit/heartbeat/" + std::to_string(rank); }
// "<host> <pid>" of a rank, so that a rank on the same host can tell a stopped process from a gone one.
std::string process_key(int rank) { return "shardit/process/" + std::to_string(rank); }

std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

// What became of a process of this host whose heartbeat stands still, from /proc/<pid>/stat's
// state: stopped (SIGSTOP, a debugger), gone (no process, or a zombie), or alive but silent.
enum class ProcessState { Gone, Stopped, Silent };
ProcessState process_state(int64_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos || paren + 2 >= stat.size()) return ProcessState::Gone;
  const char state = stat[paren + 2];
  if (state == 'T' || state == 't') return ProcessState::Stopped;
  if (state == 'Z' || state == 'X' || state == 'x') return ProcessState::Gone;
  return ProcessState::Silent;
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

// The ranks for a message: all of them when few, else the first and last few around a count, so
// that a message stays one readable line (WORLD_SIZE=100000 would list 100000 missing ranks).
std::string list_ranks(const std::vector<int>& ranks) {
  constexpr size_t kHead = 8, kTail = 2;
  if (ranks.size() <= kHead + kTail + 1) return join_ranks(ranks);
  const std::vector<int> head(ranks.begin(), ranks.begin() + kHead), tail(ranks.end() - kTail, ranks.end());
  return join_ranks(head) + ", ... (" + std::to_string(ranks.size() - kHead - kTail) + " more), " + join_ranks(tail);
}

// Each rank increments its counter in the store every kHeartbeatPeriod from its own thread (and
// its own store connection, so a collective blocked in the store never delays it). A rank whose
// counter stands still over kProbeWindow has exited, crashed, or been stopped.
class Heartbeat {
 public:
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank)
      : store_(std::move(store)), rank_(rank), thread_([this] { run(); }) {}
  ~Heartbeat() { stop(); }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // A sentence about the members of `global_ranks` (other than this rank) that were lost;
  // `when_alive` when none was.
  std::string lost_ranks(const std::vector<int>& global_ranks,
                         const std::string& when_alive = "every other member is still alive") {
    std::vector<int> others;
    for (int r : global_ranks) {
      if (r != rank_) others.push_back(r);
    }
    if (others.empty()) return when_alive;
    try {
      std::vector<int64_t> before = read(others);
      std::this_thread::sleep_for(kProbeWindow);
      std::vector<int64_t> after = read(others);
      std::vector<int> lost, stopped, silent, never_joined;
      for (size_t i = 0; i < others.size(); ++i) {
        if (after[i] == 0) {
          never_joined.push_back(others[i]);
        } else if (after[i] == before[i]) {
          switch (local_state(others[i])) {
            case ProcessState::Stopped: stopped.push_back(others[i]); break;
            case ProcessState::Silent: silent.push_back(others[i]); break;
            case ProcessState::Gone: lost.push_back(others[i]); break;
          }
        }
      }
      std::string text;
      const auto add = [&text](const std::vector<int>& ranks, const std::string& what) {
        if (ranks.empty()) return;
        text += (text.empty() ? "" : "; ") + std::string(ranks.size() == 1 ? "lost rank " : "lost ranks ") +
                list_ranks(ranks) + " (" + what + ")";
      };
      add(lost, "exited, crashed or was killed");
      add(stopped, "its process is stopped, by SIGSTOP or a debugger; SIGCONT resumes it");
      add(silent, "its process is alive but stopped answering");
      if (!never_joined.empty()) {
        text += (text.empty() ? "" : "; ") + std::string(never_joined.size() == 1 ? "rank " : "ranks ") +
                list_ranks(never_joined) + " never joined";
      }
      return text.empty() ? when_alive : text;
    } catch (const std::exception& e) {
      return "the rendezvous store hosted by rank 0 is unreachable: rank 0 exited (perhaps after "
             "another rank failed), crashed or was killed";
    }
  }

  std::vector<int64_t> read(const std::vector<int>& ranks) {
    std::lock_guard<std::mutex> lock(store_mutex_);
    std::vector<int64_t> values;
    for (int r : ranks) values.push_back(store_->add(heartbeat_key(r), 0));
    return values;
  }

 private:
  // How a rank whose heartbeat stands still is doing, when it runs on this host (known from the
  // host and pid it published); Gone otherwise (no process to look at).
  ProcessState local_state(int rank) {
    try {
      std::lock_guard<std::mutex> store_lock(store_mutex_);
      if (!store_->check({process_key(rank)})) return ProcessState::Gone;
      const std::vector<uint8_t> value = store_->get(process_key(rank));
      const std::string text(value.begin(), value.end());
      const size_t space = text.rfind(' ');
      if (space == std::string::npos || text.substr(0, space) != host_name()) return ProcessState::Gone;
      return process_state(std::stoll(text.substr(space + 1)));
    } catch (const std::exception&) {
      return ProcessState::Gone;
    }
  }

  void run() {
    try {
      const std::string me = host_name() + " " + std::to_string(::getpid());
      std::lock_guard<std::mutex> store_lock(store_mutex_);
      store_->set(process_key(rank_), std::vector<uint8_t>(me.begin(), me.end()));
    } catch (const std::exception&) {
      return;  // the store is gone (rank 0 exited): nothing left to report to
    }
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      lock.unlock();
      try {
        std::lock_guard<std::mutex> store_lock(store_mutex_);
        store_->add(heartbeat_key(rank_), 1);
      } catch (const std::exception&) {
        return;  // the store is gone (rank 0 exited): nothing left to report to
      }
      lock.lock();
      wake_.wait_for(lock, kHeartbeatPeriod, [this] { return stopping_; });
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  std::mutex store_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

using LostRanksFn = std::function<std::string(const std::vector<int>&)>;

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

World* g_world = nullptr;
std::mutex g_world_mutex;

using Clock = std::chrono::steady_clock;
constexpr auto kPollPeriod = std::chrono::milliseconds(50);

long elapsed_ms(Clock::time_point since) {
  return static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - since).count());
}

std::string as_text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> as_bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

// Rank 0 hosts the store on MASTER_PORT: a port some other program holds is reported now, by
// name, instead of as a rendezvous timeout blamed on MASTER_ADDR.
void check_port_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;  // the store's own bind will report it
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(bound || error != EADDRINUSE, "rank 0 cannot host the rendezvous store: MASTER_PORT=", port,
              " is already in use on this host (another job or program listens there); choose a free MASTER_PORT, "
              "or let `shardit --nproc-per-node N` pick one");
}

// Waits until something accepts connections at host:port (true), or until `deadline` (false). A
// client that finds no listener yet (rank 0 still starting its store) is retried by c10d only
// after a whole second, which ranks started together would nearly always pay. An address that
// does not resolve is left to the store's own connection, which names it (true).
bool wait_for_listener(const std::string& host, int port, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr) return true;
  for (;;) {
    for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) continue;
      bool connected = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
      if (!connected && errno == EINPROGRESS) {
        pollfd pending{fd, POLLOUT, 0};
        int error = 0;
        socklen_t length = sizeof(error);
        connected = ::poll(&pending, 1, 200) == 1 &&
                    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
      }
      ::close(fd);
      if (connected) {
        ::freeaddrinfo(found);
        return true;
      }
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::freeaddrinfo(found);
  return false;
}

// Runs `fn` on its own thread and waits at most `limit`: a peer that accepts the connection but
// never answers (a foreign server on MASTER_PORT) blocks inside c10d with no timeout of its own.
// On timeout the thread is abandoned (the process is about to exit with the error).
template <class T>
T run_bounded(std::chrono::milliseconds limit, std::function<T()> fn, const std::string& on_timeout) {
  struct State {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    T value{};
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  std::thread([state, fn = std::move(fn)] {
    T value{};
    std::exception_ptr error;
    try {
      value = fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->value = std::move(value);
    state->error = error;
    state->done = true;
    state->done_cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mutex);
  if (!state->done_cv.wait_for(lock, limit, [&] { return state->done; })) throw std::runtime_error(on_timeout);
  if (state->error) std::rethrow_exception(state->error);
  return std::move(state->value);
}

// Every rank writes `value` under `prefix` + its rank and waits until all `world_size` ranks have
// written theirs. `compare` is called for each other rank's value as soon as it is there, so a
// disagreement is reported at once rather than at the deadline. Throws naming the missing ranks.
void exchange(c10d::Store& store, const std::string& prefix, int rank, int world_size, const std::string& value,
              Clock::time_point deadline, const std::function<void(int, const std::string&)>& compare,
              const std::string& step) {
  store.set(prefix + std::to_string(rank), as_bytes(value));
  std::vector<bool> seen(world_size, false);
  seen[rank] = true;
  int remaining = world_size - 1;
  for (;;) {
    for (int r = 0; r < world_size; ++r) {
      // A sweep over a huge world (one store call per rank) stops at the deadline, so the error
      // below comes in time (a missed key is reported missing, never compared late).
      if (r % 256 == 255 && Clock::now() >= deadline) break;
      const std::string key = prefix + std::to_string(r);
      if (seen[r] || !store.check({key})) continue;
      seen[r] = true;
      --remaining;
      compare(r, as_text(store.get(key)));
    }
    if (remaining == 0) return;
    if (Clock::now() >= deadline) {
      std::vector<int> missing;
      for (int r = 0; r < world_size; ++r) {
        if (!seen[r]) missing.push_back(r);
      }
      throw std::runtime_error((missing.size() == 1 ? "rank " : "ranks ") + list_ranks(missing) + " " + step);
    }
    std::this_thread::sleep_for(kPollPeriod);
  }
}

// A window of `text` around byte `at`, for showing where two values differ.
std::string window(const std::string& text, size_t at) {
  const size_t begin = at > 40 ? at - 40 : 0;
  std::string out = text.substr(begin, 100);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  }
  return (begin > 0 ? "..." : "") + out + (begin + 100 < text.size() ? "..." : "");
}

}  // namespace

struct World::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  std::unique_ptr<Heartbeat> heartbeat;
  int groups_made = 0;
  int agreements = 0;
  std::mutex mailbox_mutex;  // post/take from several threads share the store's connection

  c10::intrusive_ptr<C10dBackend> make_gloo(const std::string& prefix, int rank, int size,
                                            std::chrono::milliseconds timeout) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(gloo_device);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options);
  }

  c10::intrusive_ptr<C10dBackend> make_nccl(const std::string& prefix, int rank, int size,
                                            std::chrono::milliseconds timeout, at::Device device) {
#if SHARDIT_WITH_NCCL
    if (device.is_cuda()) {
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = timeout;
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix + "/nccl", store);
      return c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, options);
    }
#endif
    return {};
  }

  LostRanksFn lost_ranks_fn() {
    Heartbeat* beat = heartbeat.get();
    if (beat == nullptr) return {};
    return [beat](const std::vector<int>& ranks) { return beat->lost_ranks(ranks); };
  }
};

World& World::init(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_world_mutex);
  if (g_world != nullptr) return *g_world;

  // Never destroyed: c10d's threads may still be blocked on a dead peer at exit. Only the
  // heartbeat thread is stopped (at exit), because it touches the store on its own.
  auto world = std::unique_ptr<World>(new World());
  world->env_ = LaunchEnv::from_environment();
  world->options_ = options;
  if (const int override_ms = timeout_override_ms()) {
    world->options_.timeout = std::chrono::milliseconds(override_ms);
  }
  const auto timeout = world->options_.timeout;
  const LaunchEnv& env = world->env_;
  world->device_ = choose_device(world->options_.device, env.local_rank);

  int threads = world->options_.threads;
  if (threads <= 0) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    threads = std::max(1, cores / std::max(1, env.local_world_size));
  }
  at::set_num_threads(threads);

#if SHARDIT_WITH_NCCL
  if (world->device_.is_cuda()) c10::cuda::set_device(world->device_.index());
#endif

  world->impl_ = std::make_shared<Impl>();
  if (env.world_size == 1) {
    world->world_group_ = Group::single();
    g_world = world.release();
    return *g_world;
  }

  Impl& impl = *world->impl_;
  const std::string host = env.master_addr.empty() ? "127.0.0.1" : env.master_addr;
  const std::string where = host + ":" + std::to_string(env.master_port);
  if (env.rank == 0) check_port_free(env.master_port);
  const auto start = Clock::now();
  try {
    TORCH_CHECK(env.rank == 0 || wait_for_listener(host, env.master_port, start + timeout),
                "nothing listens there (rank 0 hosts the store)");
    // Rank 0 hosts the store (c10d's server listens on every interface of its host); everyone
    // connects to MASTER_ADDR, or loopback when all ranks are local.
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(env.master_port);
    store_options.isServer = env.rank == 0;
    store_options.waitWorkers = false;  // the joined keys below wait, and name who is missing
    store_options.timeout = timeout;
    // Every rank announces itself with its world size, then waits for the others, so a rank that
    // never arrives is named here rather than reported as a bare socket timeout by Gloo, and a
    // rank started with another WORLD_SIZE is named as such. Rank 0 keeps the store up a little
    // longer, so the others can still ask who is missing.
    const auto deadline = start + timeout + (env.rank == 0 ? std::chrono::milliseconds(500) : std::chrono::milliseconds(0));
    const LaunchEnv env_copy = env;
    impl.store = run_bounded<c10::intrusive_ptr<c10d::Store>>(
        timeout + std::chrono::seconds(2),
        [host, store_options, env_copy, deadline] {
          c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
          const auto compare = [&](int r, const std::string& theirs) {
            if (theirs == std::to_string(env_copy.world_size)) return;
            throw std::runtime_error("rank " + std::to_string(r) + " was started with a world size of " + theirs +
                                     ", this rank with " + std::to_string(env_copy.world_size) +
                                     "; every rank needs the same WORLD_SIZE");
          };
          exchange(*store, "shardit/joined/", env_copy.rank, env_copy.world_size, std::to_string(env_copy.world_size),
                   deadline, compare, "did not join");
          return store;
        },
        "no rendezvous store answered at " + where + " (the connection was accepted but never answered: is "
        "MASTER_PORT used by another program?)");

    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
      impl.gloo_device = c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
    } else if (env.master_addr.empty()) {
      impl.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
    } else {
      impl.gloo_device = c10d::ProcessGroupGloo::createDefaultDevice();
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size, " (", launch_source_name(env.source),
                "): rendezvous at ", where, " failed within ", timeout.count(), " ms: ", error_message(e),
                env.rank == 0 ? std::string()
                              : "; check that all " + std::to_string(env.world_size) +
                                    " ranks were started with the same MASTER_ADDR/MASTER_PORT and that rank 0 is up");
  }

  std::vector<int> all(env.world_size);
  for (int r = 0; r < env.world_size; ++r) all[r] = r;
  try {
    // A second connection for the heartbeat, so it never waits behind a blocked store call.
    c10d::TCPStoreOptions beat_options;
    beat_options.port = static_cast<uint16_t>(env.master_port);
    beat_options.isServer = false;
    beat_options.waitWorkers = false;
    beat_options.timeout = std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5));
    auto beat_store = c10::make_intrusive<c10d::TCPStore>(host, beat_options);
    impl.heartbeat = std::make_unique<Heartbeat>(beat_store, env.rank);
    static std::once_flag stop_at_exit;
    std::call_once(stop_at_exit, [] {
      std::atexit([] {
        if (g_world != nullptr && g_world->impl_ && g_world->impl_->heartbeat) {
          g_world->impl_->heartbeat->stop();
        }
      });
    });

    auto gloo = impl.make_gloo("shardit/world", env.rank, env.world_size, timeout);
    auto nccl = impl.make_nccl("shardit/world", env.rank, env.world_size, timeout, world->device_);
    world->world_group_ =
        std::make_shared<C10dGroup>("world", env.rank, all, gloo, nccl, impl.lost_ranks_fn());
    // As in new_group: every rank connected before any may go on (and exit).
    world->world_group_->barrier();
  } catch (const std::exception& e) {
    const std::string lost = impl.heartbeat ? impl.heartbeat->lost_ranks(all) : "";
    TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size,
                ": setting up the world process group (rendezvous at ", where, ") failed within ",
                timeout.count(), " ms: ", error_message(e), lost.empty() ? "" : "; ", lost);
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
  // Values are compared whole up to 64 KiB; longer ones (tensor tables of big checkpoints) by a
  // digest, with their start kept for the message.
  constexpr size_t kWhole = 64 * 1024;
  const std::string record =
      topic + "\n" + (value.size() <= kWhole ? value : "#" + std::to_string(std::hash<std::string>{}(value)) + " " + value.substr(0, 200));
  const std::string prefix = "shardit/agree/" + std::to_string(impl_->agreements++) + "/";
  const auto start = Clock::now();
  try {
    const auto compare = [&](int r, const std::string& theirs) {
      if (theirs == record) return;
      const std::string their_topic = theirs.substr(0, theirs.find('\n'));
      if (their_topic != topic) {
        throw std::runtime_error("rank " + std::to_string(r) + " is checking '" + their_topic + "' while rank " +
                                 std::to_string(rank()) + " checks '" + topic + "'");
      }
      size_t at = 0;
      while (at < record.size() && at < theirs.size() && record[at] == theirs[at]) ++at;
      const size_t offset = topic.size() + 1;
      at = at > offset ? at - offset : 0;
      const std::string mine = record.substr(offset);
      const std::string other = theirs.substr(offset);
      throw std::runtime_error("ranks disagree on the " + topic + ": rank " + std::to_string(rank()) + " has '" +
                               window(mine, at) + "', rank " + std::to_string(r) + " has '" + window(other, at) +
                               "'; every rank must run the same command on the same files");
    };
    exchange(*impl_->store, prefix, rank(), size(), record, start + options_.timeout, compare,
             "did not reach the check of the " + topic + " in time");
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rank(), ": ", error_message(e), " (after ", elapsed_ms(start), " ms; timeout ",
                options_.timeout.count(), " ms)");
  }
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
    auto gloo = impl_->make_gloo(prefix, group_rank, group_size, options_.timeout);
    auto nccl = impl_->make_nccl(prefix, group_rank, group_size, options_.timeout, device_);
    auto group = std::make_shared<C10dGroup>(name, group_rank, ranks, gloo, nccl, impl_->lost_ranks_fn());
    // Constructing a Gloo group is not a synchronisation point: a member that finished connecting
    // may go on and drop the group while another is still connecting to it, which then fails with
    // "Connection closed by peer" (seen once in the suite; PyTorch's own Gloo tests flaked the same
    // way). After this barrier every member is connected.
    group->barrier();
    return group;
  } catch (const std::exception& e) {
    const std::string lost = impl_->heartbeat ? impl_->heartbeat->lost_ranks(ranks) : "";
    TORCH_CHECK(false, "new_group ", name, " failed on rank ", rank(), " within ",
                options_.timeout.count(), " ms: ", error_message(e), lost.empty() ? "" : "; ", lost);
  }
}

void World::post(const std::string& key, const std::string& value) {
  TORCH_CHECK(impl_ && impl_->store, "World::post: a world of one rank has no store");
  std::lock_guard<std::mutex> lock(impl_->mailbox_mutex);
  impl_->store->set("shardit/mailbox/" + key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::optional<std::string> World::take(const std::string& key) {
  TORCH_CHECK(impl_ && impl_->store, "World::take: a world of one rank has no store");
  const std::string full = "shardit/mailbox/" + key;
  std::lock_guard<std::mutex> lock(impl_->mailbox_mutex);
  if (!impl_->store->check({full})) return std::nullopt;
  const std::vector<uint8_t> value = impl_->store->get(full);
  impl_->store->deleteKey(full);
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
