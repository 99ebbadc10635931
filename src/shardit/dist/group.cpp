#include "shardit/dist/group.h"

#include <c10/util/Exception.h>

namespace shardit::dist {

void Work::wait() {
  if (!wait_fn_) return;
  // Waiting twice is harmless: the second call finds nothing pending.
  auto wait_fn = std::move(wait_fn_);
  wait_fn_ = nullptr;
  wait_fn();
}

int64_t Group::checked_dim(const at::Tensor& tensor, int64_t dim, const char* op) const {
  const int64_t ndim = tensor.dim();
  TORCH_CHECK(ndim > 0, op, " on group '", name(), "': needs a tensor with at least one dimension, got a scalar");
  TORCH_CHECK(dim >= -ndim && dim < ndim, op, " on group '", name(), "': dim ", dim,
              " is out of range for a tensor of shape ", tensor.sizes());
  return dim < 0 ? dim + ndim : dim;
}

namespace {

// Size 1: every collective is the identity. Calls are still counted (with no bytes) so code that
// counts collectives behaves the same at any degree.
class SingleGroup final : public Group {
 public:
  SingleGroup(int global_rank, std::string name) : ranks_{global_rank}, name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::vector<int>& global_ranks() const override { return ranks_; }
  const std::string& name() const override { return name_; }

  void all_reduce(at::Tensor& tensor) override { count("all_reduce"); }
  Work all_reduce_async(at::Tensor& tensor) override {
    count("all_reduce");
    return Work();
  }
  at::Tensor all_gather(const at::Tensor& tensor, int64_t dim) override {
    checked_dim(tensor, dim, "all_gather");
    count("all_gather");
    return tensor;
  }
  at::Tensor reduce_scatter(const at::Tensor& tensor, int64_t dim) override {
    checked_dim(tensor, dim, "reduce_scatter");
    count("reduce_scatter");
    return tensor;
  }
  at::Tensor all_to_all(const at::Tensor& tensor, int64_t scatter_dim, int64_t gather_dim) override {
    checked_dim(tensor, scatter_dim, "all_to_all");
    checked_dim(tensor, gather_dim, "all_to_all");
    count("all_to_all");
    return tensor;
  }
  Work ring_shift_async(const at::Tensor& send, at::Tensor& recv) override {
    TORCH_CHECK(send.sizes() == recv.sizes() && send.scalar_type() == recv.scalar_type(), "ring_shift on group '",
                name_, "': recv ", recv.sizes(), " ", recv.scalar_type(), " does not match send ", send.sizes(), " ",
                send.scalar_type());
    count("ring_shift");
    recv.copy_(send);
    return Work();
  }
  std::pair<at::Tensor, at::Tensor> neighbour_exchange(const at::Tensor&, const at::Tensor&) override {
    count("neighbour_exchange");
    return {};
  }
  void broadcast(at::Tensor& tensor, int root) override {
    TORCH_CHECK(root == 0, "broadcast on group '", name_, "': root ", root,
                " is out of range for a group of size 1");
    count("broadcast");
  }
  void barrier() override { count("barrier"); }

 private:
  void count(const char* op) {
    ++stats_.collectives;
    ++stats_.calls_by_op[op];
  }
  std::vector<int> ranks_;
  std::string name_;
};

}  // namespace

std::shared_ptr<Group> Group::single() { return std::make_shared<SingleGroup>(0, "single"); }

// For World::new_group (declared there): a one-member sub-group of a larger world.
std::shared_ptr<Group> make_single_group(int global_rank, std::string name) {
  return std::make_shared<SingleGroup>(global_rank, std::move(name));
}

}  // namespace shardit::dist
