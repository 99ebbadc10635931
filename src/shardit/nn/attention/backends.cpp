#include "shardit/nn/attention/backends.h"

#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <sstream>

#include "shardit/core/compat.h"
#include "shardit/core/profile.h"
#include "shardit/nn/attention/bf16_kernels.h"
#include "shardit/nn/cpu/bf16_attention.h"
#include "shardit/nn/attention/memory_efficient.h"
#include "shardit/nn/gemm.h"

namespace shardit::nn {

namespace {

at::Tensor math_attention_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& mask, double scale) {
  // The two products on the selected GEMM kernel (nn/gemm.h): 4-D matmuls on BLAS, one product
  // per (batch, head) slice on oneDNN.
  const bool sliced = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == k.size(0) &&
                      q.size(1) == k.size(1) && k.sizes() == v.sizes() &&
                      gemm_backend_for(q.device(), q.scalar_type(), q.size(2), k.size(2) * k.size(3)) ==
                          GemmBackend::OneDnn;
  // [B, h, S, D] -> [B * h, S, D] (a view for batch 1)
  const auto slices = [](const at::Tensor& t) { return t.reshape({-1, t.size(-2), t.size(-1)}); };
  // [B, h, S_q, S_kv]
  at::Tensor scores = sliced ? bmm_nt(slices(q * scale), slices(k)).view({q.size(0), q.size(1), q.size(2), k.size(2)})
                             : at::matmul(q * scale, k.transpose(-2, -1));
  if (mask.has_value() && mask->defined()) {
    if (mask->scalar_type() == at::kBool) {
      scores = scores.to(at::kFloat).masked_fill(mask->logical_not(), -std::numeric_limits<float>::infinity());
    } else {
      scores = scores.to(at::kFloat) + mask->to(at::kFloat);
    }
  }
  // The softmax in fp32 whatever the input dtype, then back for the product with v.
  at::Tensor probs = at::softmax(scores, -1, at::kFloat);
  if (probs.scalar_type() != v.scalar_type()) probs = probs.to(v.scalar_type());
  // [B, h, S_q, D]
  if (sliced && probs.scalar_type() == at::kFloat) {
    return bmm_nn(slices(probs), slices(v)).view({q.size(0), q.size(1), q.size(2), v.size(3)});
  }
  return at::matmul(probs, v);
}

std::string device_list(const std::vector<c10::DeviceType>& devices) {
  std::string out;
  for (const auto d : devices) out += (out.empty() ? "" : ", ") + c10::DeviceTypeName(d, /*lower_case=*/true);
  return out;
}

std::string dtype_list(const std::vector<at::ScalarType>& dtypes) {
  std::string out;
  for (const auto d : dtypes) out += (out.empty() ? "" : ", ") + std::string(c10::toString(d));
  return out;
}

struct Registry {
  std::mutex mutex;
  std::map<std::string, AttentionBackend> backends;
  std::string selection = "auto";
  std::map<std::string, int64_t> counts;
};

void register_builtins(Registry& registry) {
  AttentionBackend math;
  math.name = "math";
  math.description = "reference: scores materialised per head group, softmax in fp32";
  math.run = [](const AttentionCall& c) { return math_attention(c.q, c.k, c.v, c.mask, c.scale); };
  registry.backends.emplace(math.name, std::move(math));

  AttentionBackend efficient;
  efficient.name = "memory_efficient";
  efficient.description = "key/value blocks streamed with an online softmax; memory linear in the sequence";
  efficient.returns_lse = true;
  efficient.run = [](const AttentionCall& c) {
    return memory_efficient_attention(c.q, c.k, c.v, c.mask, c.scale).output;
  };
  registry.backends.emplace(efficient.name, std::move(efficient));

  for (const cpu::Bf16AttentionKernel kernel : {cpu::Bf16AttentionKernel::amx, cpu::Bf16AttentionKernel::avx512_bf16}) {
    AttentionBackend own;
    own.name = cpu::bf16_attention_kernel_name(kernel);
    own.description = kernel == cpu::Bf16AttentionKernel::amx
                          ? "bf16 in one kernel on AMX tiles: 32 queries at a time, each row's softmax whole"
                          : "bf16 in one kernel on AVX512-BF16 pair dot products: 32 queries at a time, each "
                            "row's softmax whole";
    own.devices = {c10::DeviceType::CPU};
    own.dtypes = {at::kBFloat16};
    own.returns_lse = true;
    own.refuses = [kernel](const AttentionCall& c) {
      return bf16_kernel_attention_refusal(kernel, c.q, c.k, c.v, c.mask, c.scale);
    };
    own.run = [kernel](const AttentionCall& c) {
      return bf16_kernel_attention(kernel, c.q, c.k, c.v, c.mask, c.scale).output;
    };
    registry.backends.emplace(own.name, std::move(own));
  }

#if SHARDIT_HAS_SDPA
  AttentionBackend sdpa;
  sdpa.name = "sdpa";
  sdpa.description = "LibTorch's fused at::scaled_dot_product_attention (flash / memory-efficient / math)";
  sdpa.run = [](const AttentionCall& c) {
    // The `scale` argument only exists from 2.1 on, so the scale is folded into q.
    const double default_scale = 1.0 / std::sqrt(static_cast<double>(c.q.size(-1)));
    c10::optional<at::Tensor> attn_mask;
    if (c.mask.has_value() && c.mask->defined()) attn_mask = *c.mask;
    const at::Tensor query = std::abs(c.scale - default_scale) > 0 ? c.q * (c.scale / default_scale) : c.q;
    return at::scaled_dot_product_attention(query, c.k, c.v, attn_mask);
  };
  registry.backends.emplace(sdpa.name, std::move(sdpa));
#endif
}

Registry& registry() {
  static Registry* instance = [] {
    auto* r = new Registry();
    register_builtins(*r);
    if (const char* env = std::getenv("SHARDIT_ATTENTION_BACKEND"); env != nullptr && *env != '\0') {
      r->selection = env;
    }
    return r;
  }();
  return *instance;
}

std::string names_locked(const Registry& r) {
  std::string out;
  for (const auto& entry : r.backends) out += (out.empty() ? "" : ", ") + entry.first;
  return out;
}

}  // namespace

at::Tensor math_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double scale) {
  const int64_t heads = q.size(1);
  const int64_t bytes_per_head = q.size(0) * q.size(2) * k.size(2) * static_cast<int64_t>(sizeof(float));
  const int64_t group =
      std::max<int64_t>(1, std::min<int64_t>(heads, kMathScoresBudgetBytes / std::max<int64_t>(1, bytes_per_head)));
  if (group >= heads) return math_attention_heads(q, k, v, mask, scale);
  // The heads dimension of a mask is its third from last ([H, S_q, S_kv] or [B, H, S_q, S_kv]); a
  // mask broadcast over heads (size 1 there, or fewer dimensions) applies to every group as it is.
  const bool mask_per_head = mask.has_value() && mask->defined() && mask->dim() >= 3 && mask->size(-3) > 1;
  std::vector<at::Tensor> outputs;
  for (int64_t h = 0; h < heads; h += group) {
    const int64_t n = std::min(group, heads - h);
    std::optional<at::Tensor> group_mask = mask;
    if (mask_per_head) group_mask = mask->narrow(mask->dim() - 3, h, n);
    outputs.push_back(math_attention_heads(q.narrow(1, h, n), k.narrow(1, h, n), v.narrow(1, h, n), group_mask, scale));
  }
  // [B, H, S_q, D]
  return at::cat(outputs, 1);
}

void register_attention_backend(AttentionBackend backend) {
  TORCH_CHECK(!backend.name.empty() && backend.name != "auto", "register_attention_backend: invalid name '",
              backend.name, "' (empty and \"auto\" are reserved)");
  TORCH_CHECK(static_cast<bool>(backend.run), "register_attention_backend: backend '", backend.name,
              "' has no run function");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.backends[backend.name] = std::move(backend);
}

std::vector<std::string> attention_backend_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& entry : r.backends) names.push_back(entry.first);
  return names;
}

const AttentionBackend& attention_backend(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.backends.find(name);
  if (it == r.backends.end()) {
    std::string hint;
    if (name == "sdpa" && !SHARDIT_HAS_SDPA) {
      hint = "; sdpa needs LibTorch 2.0 or later (this build links " + std::string(TORCH_VERSION) +
             ", without at::scaled_dot_product_attention)";
    }
    TORCH_CHECK(false, "attention backend '", name, "' is not available", hint, "; available: auto, ",
                names_locked(r));
  }
  return it->second;
}

std::string attention_backend_refusal(const AttentionBackend& backend, const AttentionCall& call) {
  const c10::DeviceType device = call.q.device().type();
  if (!backend.devices.empty() &&
      std::find(backend.devices.begin(), backend.devices.end(), device) == backend.devices.end()) {
    return "it runs on " + device_list(backend.devices) + ", not on " + c10::DeviceTypeName(device, true);
  }
  const at::ScalarType dtype = call.q.scalar_type();
  if (!at::isFloatingType(dtype)) return std::string("q is ") + c10::toString(dtype) + ", not floating point";
  if (!backend.dtypes.empty() && std::find(backend.dtypes.begin(), backend.dtypes.end(), dtype) == backend.dtypes.end()) {
    return std::string("it takes ") + dtype_list(backend.dtypes) + ", not " + c10::toString(dtype);
  }
  if (!backend.supports_mask && call.mask.has_value() && call.mask->defined()) return "it does not support masks";
  if (backend.refuses) return backend.refuses(call);
  return "";
}

std::vector<std::string> default_attention_backends(c10::DeviceType device) {
  if (device == c10::DeviceType::CPU) return {"amx", "avx512_bf16", "memory_efficient", "math"};
  return {"sdpa", "memory_efficient", "math"};
}

void set_attention_backend(const std::string& name) {
  if (name != "auto") attention_backend(name);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.selection = name;
}

std::string attention_backend_selection() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.selection;
}

AttentionBackendGuard::AttentionBackendGuard(const std::string& name) : previous_(attention_backend_selection()) {
  set_attention_backend(name);
}

AttentionBackendGuard::~AttentionBackendGuard() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.selection = previous_;
}

const AttentionBackend& attention_backend_for(const AttentionCall& call) {
  const std::string selection = attention_backend_selection();
  const AttentionBackend* chosen = nullptr;
  if (selection == "auto") {
    std::string reasons;
    for (const auto& name : default_attention_backends(call.q.device().type())) {
      const AttentionBackend* candidate = nullptr;
      {
        Registry& r = registry();
        std::lock_guard<std::mutex> lock(r.mutex);
        const auto it = r.backends.find(name);
        if (it != r.backends.end()) candidate = &it->second;
      }
      if (candidate == nullptr) continue;
      const std::string why = attention_backend_refusal(*candidate, call);
      if (why.empty()) {
        chosen = candidate;
        break;
      }
      reasons += "; " + name + ": " + why;
    }
    TORCH_CHECK(chosen != nullptr, "attention: no backend accepts this call (q ", call.q.sizes(), " ",
                call.q.scalar_type(), " on ", call.q.device(), ")", reasons);
  } else {
    chosen = &attention_backend(selection);
    const std::string why = attention_backend_refusal(*chosen, call);
    TORCH_CHECK(why.empty(), "attention backend '", selection, "' cannot run this call (q ", call.q.sizes(), " ",
                call.q.scalar_type(), " on ", call.q.device(), (call.mask.has_value() ? ", with a mask" : ""),
                "): ", why, "; choose another with --attention-backend (or auto)");
  }
  return *chosen;
}

std::string cpu_attention_backend(at::ScalarType dtype) {
  const at::Tensor q = at::zeros({1, 1, 32, 128}, at::TensorOptions().dtype(dtype));
  const std::optional<at::Tensor> no_mask;
  const AttentionCall call{q, q, q, no_mask, 1.0 / std::sqrt(128.0)};
  return attention_backend_for(call).name;
}

at::Tensor dispatch_attention(const AttentionCall& call) {
  const AttentionBackend* chosen = &attention_backend_for(call);
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    ++r.counts[chosen->name];
  }
  return chosen->run(call);
}

std::map<std::string, int64_t> attention_dispatch_counts() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.counts;
}

void reset_attention_dispatch_counts() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.counts.clear();
}

}  // namespace shardit::nn
