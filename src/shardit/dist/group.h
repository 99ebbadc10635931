#pragma once
// Process groups and the collectives the layers above use, on c10d (Gloo for CPU tensors, NCCL
// for CUDA tensors when LibTorch has it). A group of size 1 needs no backend: every collective is
// the identity, so single-process code runs the same path.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardit::dist {

/// What a group has sent, for benchmarks and for tests that count all-reduces.
///
/// bytes_sent counts what this rank sends under the bandwidth-optimal algorithms, for a group of
/// n members and B = the caller's tensor bytes (its own dtype, whatever the backend puts on the
/// wire; Gloo sums f16/bf16 as f32, twice the bytes):
///   all_reduce      2(n-1)/n * B          (ring reduce-scatter + ring all-gather)
///   all_gather      (n-1)/n * B_out = (n-1) * B_in
///   reduce_scatter  (n-1)/n * B_in        (done as one all-to-all plus a local sum on Gloo)
///   all_to_all      (n-1)/n * B_in
///   ring_shift      B                     (to the next member only)
///   neighbour_exchange  the bytes sent to the members that exist (B_prev + B_next)
///   broadcast       B on the root, 0 elsewhere
///   barrier         0
/// Every call counts in `collectives` and `calls_by_op`, also on a size-1 group (with 0 bytes).
struct CommStats {
  uint64_t collectives = 0;   ///< number of collective calls
  uint64_t bytes_sent = 0;    ///< bytes this rank sent, by the ring algorithms' count
  std::map<std::string, uint64_t> calls_by_op;  ///< "all_reduce" -> count
  void reset() { *this = CommStats{}; }
};

/// A pending collective. wait() rethrows the collective's error (naming the group and the op).
/// The result is in the tensor only after wait() returns (half types are summed in a f32 copy
/// and written back there); dropping a Work without waiting leaves the tensor unspecified.
class Work {
 public:
  Work() = default;
  explicit Work(std::function<void()> wait_fn) : wait_fn_(std::move(wait_fn)) {}
  void wait();

 private:
  std::function<void()> wait_fn_;
};

/// A set of ranks that run collectives together. Every member must call the same collectives in
/// the same order. Errors (a peer that died, a timeout) throw c10::Error naming the group, the op
/// and the cause.
class Group {
 public:
  virtual ~Group() = default;
  /// This process's index in the group.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Global ranks of the members, in group order.
  virtual const std::vector<int>& global_ranks() const = 0;
  virtual const std::string& name() const = 0;

  /// Sum over the group, in place. f32, bf16, f16 (and f64, integers).
  virtual void all_reduce(at::Tensor& tensor) = 0;
  virtual Work all_reduce_async(at::Tensor& tensor) = 0;
  /// Concatenation of every member's `tensor` along `dim`, in group order.
  virtual at::Tensor all_gather(const at::Tensor& tensor, int64_t dim) = 0;
  /// Sum over the group, then this member's 1/size chunk along `dim` (which size must divide).
  virtual at::Tensor reduce_scatter(const at::Tensor& tensor, int64_t dim) = 0;
  /// Splits `tensor` into size chunks along `scatter_dim`, sends chunk j to member j, and
  /// concatenates the received chunks along `gather_dim` (Ulysses attention's exchange).
  virtual at::Tensor all_to_all(const at::Tensor& tensor, int64_t scatter_dim,
                                int64_t gather_dim) = 0;
  /// Sends `send` to member (rank + 1) % size and receives member (rank - 1) % size's tensor into
  /// `recv` (same shape and dtype on every member): one step of ring attention's key/value
  /// rotation. Asynchronous, so the next block travels while the current one is computed; `recv`
  /// holds the result only after wait(), and `send` must not change before it.
  virtual Work ring_shift_async(const at::Tensor& send, at::Tensor& recv) = 0;
  /// The halo exchange of a tensor split into bands in group order: sends `to_previous` to member
  /// rank - 1 and `to_next` to member rank + 1, and returns {from_previous, from_next}: what
  /// member rank - 1 sent as its to_next and what member rank + 1 sent as its to_previous. The
  /// first member has no previous and the last no next: the tensor for a missing neighbour is not
  /// sent (it may be undefined) and the one from it is undefined. A received tensor has the shape
  /// and dtype of the one sent back to that neighbour (from_previous those of to_previous), so
  /// neighbours must exchange tensors of equal shapes. Every member calls it.
  virtual std::pair<at::Tensor, at::Tensor> neighbour_exchange(const at::Tensor& to_previous,
                                                               const at::Tensor& to_next) = 0;
  /// Copies member `root`'s tensor into everyone's, in place.
  virtual void broadcast(at::Tensor& tensor, int root) = 0;
  virtual void barrier() = 0;

  CommStats& stats() { return stats_; }

  /// A group holding only this process (size 1): every collective is the identity.
  static std::shared_ptr<Group> single();

 protected:
  /// `dim` of `tensor` made non-negative; an error naming `op` and the group when the tensor is a
  /// scalar or `dim` is out of range.
  int64_t checked_dim(const at::Tensor& tensor, int64_t dim, const char* op) const;

  CommStats stats_;
};

}  // namespace shardit::dist
