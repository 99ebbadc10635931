#include "shardit/nn/module.h"

#include <c10/util/Exception.h>

namespace shardit::nn {

std::vector<Module::ParameterSlot> Module::named_parameters(const std::string& prefix) {
  std::vector<ParameterSlot> out;
  for (auto& [module_name, module] : named_modules(prefix)) {
    for (auto& [param_name, slot] : module->params_) {
      out.push_back({module_name.empty() ? param_name : module_name + "." + param_name, slot, module});
    }
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

int64_t Module::parameter_bytes() {
  int64_t total = 0;
  for (auto& p : named_parameters()) {
    if (p.tensor->defined()) total += p.tensor->numel() * static_cast<int64_t>(p.tensor->element_size());
  }
  return total;
}

void Module::to(at::Device device, at::ScalarType dtype) {
  for (auto& p : named_parameters()) {
    at::Tensor& t = *p.tensor;
    if (!t.defined() || t.is_meta()) continue;
    t = t.to(device, t.is_floating_point() ? dtype : t.scalar_type());
  }
}

bool Module::is_materialized() {
  for (auto& p : named_parameters()) {
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
}

}  // namespace shardit::nn
