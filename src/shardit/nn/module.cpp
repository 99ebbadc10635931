#include "shardit/nn/module.h"

#include <c10/util/Exception.h>

#include <utility>

namespace shardit::nn {

namespace {

thread_local const ForwardObserver* current_observer = nullptr;

}  // namespace

ObserveForward::ObserveForward(ForwardObserver observer)
    : observer_(std::move(observer)), previous_(current_observer) {
  current_observer = observer_ ? &observer_ : nullptr;
}

ObserveForward::~ObserveForward() { current_observer = previous_; }

bool Module::observed() { return current_observer != nullptr; }

void Module::emit(const std::string& name, const at::Tensor& value) const {
  if (current_observer == nullptr) return;
  (*current_observer)(path(), name, value);
}

std::string Module::path() const {
  if (parent_ == nullptr) return "";
  const std::string above = parent_->path();
  return above.empty() ? name_ : above + "." + name_;
}

std::vector<Module::TensorSlot> Module::named_parameters(const std::string& prefix) {
  std::vector<TensorSlot> out;
  for (auto& [module_name, module] : named_modules(prefix)) {
    for (auto& [param_name, slot] : module->params_) {
      out.push_back({module_name.empty() ? param_name : module_name + "." + param_name, slot, module});
    }
  }
  return out;
}

std::vector<Module::TensorSlot> Module::named_buffers(const std::string& prefix) {
  std::vector<TensorSlot> out;
  for (auto& [module_name, module] : named_modules(prefix)) {
    for (const BufferEntry& buffer : module->buffers_) {
      out.push_back({module_name.empty() ? buffer.name : module_name + "." + buffer.name, buffer.tensor, module,
                     /*is_buffer=*/true, buffer.persistent});
    }
  }
  return out;
}

std::vector<Module::TensorSlot> Module::named_states(const std::string& prefix) {
  std::vector<TensorSlot> out = named_parameters(prefix);
  for (TensorSlot& buffer : named_buffers(prefix)) {
    if (buffer.persistent) out.push_back(std::move(buffer));
  }
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules(const std::string& prefix) {
  std::vector<std::pair<std::string, Module*>> out{{prefix, this}};
  for (auto& [child_name, child] : children_) {
    auto sub = child->named_modules(prefix.empty() ? child_name : prefix + "." + child_name);
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

Module* Module::find_module(const std::string& path) {
  if (path.empty()) return this;
  const auto dot = path.find('.');
  const std::string head = path.substr(0, dot);
  for (auto& [child_name, child] : children_) {
    if (child_name == head) {
      return dot == std::string::npos ? child.get() : child->find_module(path.substr(dot + 1));
    }
  }
  return nullptr;
}

bool keeps_fp32(const std::string& tensor_name, const std::vector<std::string>& modules) {
  if (modules.empty()) return false;
  size_t begin = 0;
  while (begin <= tensor_name.size()) {
    const size_t dot = tensor_name.find('.', begin);
    const std::string segment = tensor_name.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin);
    for (const std::string& module : modules) {
      if (segment == module) return true;
    }
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  return false;
}

int64_t Module::parameter_bytes() {
  int64_t total = 0;
  for (auto& p : named_parameters()) {
    if (p.tensor->defined()) total += p.tensor->numel() * static_cast<int64_t>(p.tensor->element_size());
  }
  return total;
}

void Module::to(at::Device device, at::ScalarType dtype, const std::vector<std::string>& keep_in_fp32) {
  std::vector<TensorSlot> slots = named_parameters();
  for (TensorSlot& buffer : named_buffers()) slots.push_back(std::move(buffer));
  for (auto& slot : slots) {
    at::Tensor& t = *slot.tensor;
    if (!t.defined() || t.is_meta()) continue;
    const at::ScalarType target =
        !t.is_floating_point() ? t.scalar_type() : keeps_fp32(slot.name, keep_in_fp32) ? at::kFloat : dtype;
    t = t.to(device, target);
  }
}

bool Module::is_materialized() {
  for (auto& p : named_states()) {
    if (!p.tensor->defined() || p.tensor->is_meta()) return false;
  }
  return true;
}

void Module::register_parameter(const std::string& name, at::Tensor* slot, at::IntArrayRef shape) {
  TORCH_INTERNAL_ASSERT(slot != nullptr, "register_parameter('", name, "'): null slot");
  for (auto& [existing, unused] : params_) {
    TORCH_INTERNAL_ASSERT(existing != name, "parameter '", name, "' registered twice");
  }
  *slot = at::empty(shape, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
  params_.emplace_back(name, slot);
}

void Module::register_buffer(const std::string& name, at::Tensor* slot, at::IntArrayRef shape, bool persistent,
                             const at::Tensor& initial) {
  TORCH_INTERNAL_ASSERT(slot != nullptr, "register_buffer('", name, "'): null slot");
  for (const BufferEntry& existing : buffers_) {
    TORCH_INTERNAL_ASSERT(existing.name != name, "buffer '", name, "' registered twice");
  }
  for (auto& [existing, unused] : params_) {
    TORCH_INTERNAL_ASSERT(existing != name, "buffer '", name, "' has a parameter's name");
  }
  if (initial.defined()) {
    TORCH_INTERNAL_ASSERT(initial.sizes() == shape, "register_buffer('", name, "'): initial value has shape ",
                          initial.sizes(), ", declared ", shape);
    *slot = initial;
  } else {
    TORCH_INTERNAL_ASSERT(persistent, "register_buffer('", name,
                          "'): a non-persistent buffer is never loaded, so it needs an initial value");
    *slot = at::empty(shape, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
  }
  buffers_.push_back({name, slot, persistent});
}

void init_random(Module& module, uint64_t seed, at::ScalarType dtype, at::Device device) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& p : module.named_parameters()) {
    at::Tensor& t = *p.tensor;
    const bool is_norm_weight = t.dim() == 1 && p.name.size() >= 6 &&
                                p.name.compare(p.name.size() - 6, 6, "weight") == 0 &&
                                p.name.find("norm") != std::string::npos;
    at::Tensor values = is_norm_weight
                            ? at::ones(t.sizes(), at::kFloat)
                            : at::normal(0.0, 0.02, t.sizes(), generator, at::TensorOptions().dtype(at::kFloat));
    t = values.to(device, dtype);
  }
  // Persistent buffers hold statistics: zeros, and ones for variances (a valid normaliser).
  for (auto& b : module.named_buffers()) {
    at::Tensor& t = *b.tensor;
    if (!b.persistent) continue;
    const bool is_variance = b.name.size() >= 3 && b.name.compare(b.name.size() - 3, 3, "var") == 0;
    t = (is_variance ? at::ones(t.sizes(), at::kFloat) : at::zeros(t.sizes(), at::kFloat)).to(device, dtype);
  }
}

}  // namespace shardit::nn
