#pragma once
// The module idiom of torch::nn, lightly: typed public members, registered by name so that the
// dotted parameter names are exactly the checkpoint keys. Parameters are declared with their full
// shape on the meta device (no memory); loaders and the tensor-parallel sharder then fill each
// registered slot with real (possibly sharded) data.
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardit::nn {

/// Receives named tensors that modules emit during a forward (see Module::emit): parity tests
/// record intermediates with it, and later hooks attach the same way. `module_path` is the dotted
/// path of the emitting module below the model ("" for the model itself).
using ForwardObserver =
    std::function<void(const std::string& module_path, const std::string& name, const at::Tensor& value)>;

/// Installs `observer` for the forwards run on this thread while the scope lives (scopes nest; the
/// innermost wins). Without one, Module::emit costs one thread-local read.
class ObserveForward {
 public:
  explicit ObserveForward(ForwardObserver observer);
  ~ObserveForward();
  ObserveForward(const ObserveForward&) = delete;
  ObserveForward& operator=(const ObserveForward&) = delete;

 private:
  ForwardObserver observer_;
  const ForwardObserver* previous_;
};

class Module {
 public:
  /// A registered tensor (parameter or buffer): its dotted name and the member it lives in.
  struct TensorSlot {
    std::string name;
    at::Tensor* tensor;
    Module* owner;
    bool is_buffer = false;
    /// Buffers only: saved in and loaded from checkpoints (torch's `persistent`).
    bool persistent = true;
  };

  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// The reference class name ("Linear", "FluxTransformerBlock"), for messages.
  virtual std::string type_name() const = 0;

  /// Every parameter below this module, depth first in registration order, named
  /// `prefix.child.param`.
  std::vector<TensorSlot> named_parameters(const std::string& prefix = "");
  /// Every buffer below this module (persistent or not), named like the parameters.
  std::vector<TensorSlot> named_buffers(const std::string& prefix = "");
  /// What a checkpoint holds: the parameters, then the persistent buffers (the state dict).
  std::vector<TensorSlot> named_states(const std::string& prefix = "");
  /// This module (named `prefix`) and every descendant, depth first.
  std::vector<std::pair<std::string, Module*>> named_modules(const std::string& prefix = "");
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const {
    return children_;
  }
  /// The descendant at a dotted path ("transformer_blocks.0.attn"), or nullptr.
  Module* find_module(const std::string& path);
  /// Own parameters (not the children's).
  const std::vector<std::pair<std::string, at::Tensor*>>& own_parameters() const { return params_; }
  /// The dotted path of this module below the root it was registered in ("" for a root).
  std::string path() const;

  /// Total bytes of the parameters as they are now (local shards after sharding).
  int64_t parameter_bytes();
  /// Casts every floating-point parameter and buffer to `dtype` (those under a module named in
  /// `keep_in_fp32`, see keeps_fp32, stay fp32) and moves it to `device`.
  void to(at::Device device, at::ScalarType dtype, const std::vector<std::string>& keep_in_fp32 = {});
  /// True when no parameter or persistent buffer is still on the meta device.
  bool is_materialized();

  /// Passes `value` to the thread's ForwardObserver, if any, as (this module's path, name).
  void emit(const std::string& name, const at::Tensor& value) const;
  /// True while a ForwardObserver is installed on this thread (to skip work done only for it).
  static bool observed();

 protected:
  /// Declares a parameter of `shape` (on the meta device until loaded) stored in `*slot`.
  void register_parameter(const std::string& name, at::Tensor* slot, at::IntArrayRef shape);
  /// Declares a buffer stored in `*slot`: state that is not trained (BatchNorm running
  /// statistics, position tables). A persistent buffer is part of the checkpoint: declared on the
  /// meta device with `shape` and loaded like a parameter (never sharded). A non-persistent one is
  /// computed by the module: pass its value as `initial`.
  void register_buffer(const std::string& name, at::Tensor* slot, at::IntArrayRef shape, bool persistent = true,
                       const at::Tensor& initial = {});
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    for (const auto& child : children_) {
      TORCH_INTERNAL_ASSERT(child.first != name, "module '", name, "' registered twice");
    }
    TORCH_INTERNAL_ASSERT(module->parent_ == nullptr, "module '", name, "' already has a parent");
    module->parent_ = this;
    module->name_ = name;
    children_.emplace_back(name, module);
    return module;
  }

 private:
  struct BufferEntry {
    std::string name;
    at::Tensor* tensor;
    bool persistent;
  };
  std::vector<std::pair<std::string, at::Tensor*>> params_;
  std::vector<BufferEntry> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  const Module* parent_ = nullptr;
  std::string name_;
};

/// diffusers' `_keep_in_fp32_modules` rule: a tensor stays fp32 when one of the dotted segments of
/// its name equals one of `modules` ("norm_out" keeps "norm_out.linear.weight").
bool keeps_fp32(const std::string& tensor_name, const std::vector<std::string>& modules);

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
