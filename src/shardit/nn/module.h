#pragma once
// The module idiom of torch::nn, lightly: typed public members, registered by name so that the
// dotted parameter names are exactly the checkpoint keys. Parameters are declared with their full
// shape on the meta device (no memory); loaders and the tensor-parallel sharder then fill each
// registered slot with real (possibly sharded) data.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardit::nn {

class Module {
 public:
  /// A registered parameter: its dotted name and the member it lives in.
  struct ParameterSlot {
    std::string name;
    at::Tensor* tensor;
    Module* owner;
  };

  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// The reference class name ("Linear", "FluxTransformerBlock"), for messages.
  virtual std::string type_name() const = 0;

  /// Every parameter below this module, depth first in registration order, named
  /// `prefix.child.param`.
  std::vector<ParameterSlot> named_parameters(const std::string& prefix = "");
  /// This module (named `prefix`) and every descendant, depth first.
  std::vector<std::pair<std::string, Module*>> named_modules(const std::string& prefix = "");
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const {
    return children_;
  }
  /// The descendant at a dotted path ("transformer_blocks.0.attn"), or nullptr.
  Module* find_module(const std::string& path);
  /// Own parameters (not the children's).
  const std::vector<std::pair<std::string, at::Tensor*>>& own_parameters() const { return params_; }

  /// Total bytes of the parameters as they are now (local shards after sharding).
  int64_t parameter_bytes();
  /// Casts every floating-point parameter to `dtype` and moves it to `device`.
  void to(at::Device device, at::ScalarType dtype);
  /// True when no parameter is still on the meta device.
  bool is_materialized();

 protected:
  /// Declares a parameter of `shape` (on the meta device until loaded) stored in `*slot`.
  void register_parameter(const std::string& name, at::Tensor* slot, at::IntArrayRef shape);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    for (const auto& child : children_) {
      TORCH_INTERNAL_ASSERT(child.first != name, "module '", name, "' registered twice");
    }
    children_.emplace_back(name, module);
    return module;
  }

 private:
  std::vector<std::pair<std::string, at::Tensor*>> params_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

/// Marks the module lists (`transformer_blocks`), the only places a plan's `*` may stand.
class ModuleListBase : public Module {
 public:
  virtual size_t size() const = 0;
};

/// An indexed list of modules of one type, named "0", "1", ... as in torch.nn.ModuleList.
template <class M>
class ModuleList : public ModuleListBase {
 public:
  std::string type_name() const override { return "ModuleList"; }
  void push_back(std::shared_ptr<M> module) {
    items_.push_back(register_module(std::to_string(items_.size()), std::move(module)));
  }
  size_t size() const override { return items_.size(); }
  M& operator[](size_t i) { return *items_.at(i); }
  typename std::vector<std::shared_ptr<M>>::iterator begin() { return items_.begin(); }
  typename std::vector<std::shared_ptr<M>>::iterator end() { return items_.end(); }

 private:
  std::vector<std::shared_ptr<M>> items_;
};

/// Fills every parameter with deterministic random values (normal, std 0.02; norm weights 1):
/// for benchmarks and tests that need a model without a checkpoint. Parameters that are
/// already materialized are overwritten.
void init_random(Module& module, uint64_t seed, at::ScalarType dtype = at::kFloat,
                 at::Device device = at::kCPU);

}  // namespace shardit::nn
