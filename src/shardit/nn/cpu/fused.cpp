#include "shardit/nn/cpu/fused.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "shardit/core/profile.h"
#include "shardit/nn/cpu/dispatch.h"
#include "shardit/nn/cpu/fused_table.h"

namespace shardit::nn::cpu {

namespace {

/// The builds the kernels may run here (cpu_isa(): this CPU, capped by SHARDIT_CPU_ISA), best
/// first, and "off" (LibTorch's operators).
const std::vector<FusedKernelTable>& runnable_builds() {
  static const std::vector<FusedKernelTable> builds = [] {
    std::vector<FusedKernelTable> out;
    const std::pair<CpuIsa, FusedKernelTable (*)()> vector_builds[] = {
        {CpuIsa::Avx512Bf16, &fused_kernels_avx512_bf16},
        {CpuIsa::Avx512, &fused_kernels_avx512},
        {CpuIsa::Avx2, &fused_kernels_avx2},
    };
    for (const auto& [isa, build] : vector_builds) {
      if (!cpu_isa_allows(isa)) continue;
      FusedKernelTable t = build();
      if (t.softmax_row_f32 != nullptr) out.push_back(t);  // null: not compiled in this build
    }
    out.push_back(fused_kernels_default());
    FusedKernelTable off;
    off.name = "off";
    out.push_back(off);
    return out;
  }();
  return builds;
}

const FusedKernelTable& build_named(const std::string& name, const char* source) {
  std::string names;
  for (const FusedKernelTable& build : runnable_builds()) {
    if (name == build.name) return build;
    names += (names.empty() ? "" : ", ") + std::string(build.name);
  }
  TORCH_CHECK(false, source, " is '", name, "', which this CPU cannot run (or this build lacks); choose one of ",
              names);
}

/// The table the process runs: the best the kernels may use here.
const FusedKernelTable& process_kernels() { return runnable_builds().front(); }

std::atomic<const FusedKernelTable*> scoped_kernels{nullptr};

const FusedKernelTable& kernels() {
  const FusedKernelTable* scoped = scoped_kernels.load(std::memory_order_acquire);
  return scoped != nullptr ? *scoped : process_kernels();
}

bool on_cpu(const at::Tensor& t) { return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided; }

/// The element offset of each row (every index but the last dimension's) of a strided tensor.
class Rows {
 public:
  explicit Rows(const at::Tensor& t) {
    for (int64_t d = 0; d + 1 < t.dim(); ++d) {
      sizes_.push_back(t.size(d));
      strides_.push_back(t.stride(d));
      count_ *= t.size(d);
    }
  }
  int64_t count() const { return count_; }
  /// The index of `row` along dimension d, and the element offset of the row.
  int64_t offset(int64_t row, int64_t* index_of_dim = nullptr, int64_t dim = -1) const {
    int64_t offset = 0;
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      const int64_t index = row % sizes_[d];
      row /= sizes_[d];
      offset += index * strides_[d];
      if (d == dim && index_of_dim != nullptr) *index_of_dim = index;
    }
    return offset;
  }

 private:
  std::vector<int64_t> sizes_, strides_;
  int64_t count_ = 1;
};

/// Rows per task: enough elements that a task outweighs the thread pool's overhead.
int64_t grain_rows(int64_t row_length) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, row_length)); }

}  // namespace

const char* fused_kernels_name() { return kernels().name; }

bool fused_kernels_enabled() { return kernels().softmax_row_f32 != nullptr; }

std::vector<std::string> fused_kernel_builds() {
  std::vector<std::string> names;
  for (const FusedKernelTable& build : runnable_builds()) names.emplace_back(build.name);
  return names;
}

FusedKernelsScope::FusedKernelsScope(const std::string& build)
    : previous_(scoped_kernels.exchange(&build_named(build, "FusedKernelsScope"), std::memory_order_acq_rel)) {}

FusedKernelsScope::~FusedKernelsScope() {
  scoped_kernels.store(static_cast<const FusedKernelTable*>(previous_), std::memory_order_release);
}

bool try_gelu_tanh_(const at::Tensor& x) {
  const FusedKernelTable& k = kernels();
  // fp32 stays on LibTorch's kernel, already vectorised there (and the fp32 parity baseline).
  if (k.gelu_tanh_bf16 == nullptr || !on_cpu(x) || !x.is_contiguous() || x.scalar_type() != at::kBFloat16) {
    return false;
  }
  auto* data = x.data_ptr<at::BFloat16>();
  SHARDIT_PROFILE_SCOPE("fused gelu_tanh");
  at::parallel_for(0, x.numel(), int64_t{1} << 16,
                   [&](int64_t begin, int64_t end) { k.gelu_tanh_bf16(data + begin, end - begin); });
  return true;
}

bool try_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const FusedKernelTable& k = kernels();
  if (k.rms_norm_row_bf16 == nullptr || !on_cpu(x) || x.scalar_type() != at::kBFloat16 || x.dim() < 1 ||
      x.size(-1) == 0 || x.stride(-1) != 1) {
    return false;
  }
  const bool has_weight = weight.defined();
  if (has_weight && (!on_cpu(weight) || !weight.is_contiguous() || weight.numel() != x.size(-1) ||
                     (weight.scalar_type() != at::kBFloat16 && weight.scalar_type() != at::kFloat))) {
    return false;
  }
  out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1);
  const Rows rows(x);
  const auto* in = x.data_ptr<at::BFloat16>();
  auto* result = out.data_ptr<at::BFloat16>();
  const float epsilon = static_cast<float>(eps);
  const bool bf16_weight = has_weight && weight.scalar_type() == at::kBFloat16;
  const at::BFloat16* w16 = bf16_weight ? weight.data_ptr<at::BFloat16>() : nullptr;
  const float* w32 = has_weight && !bf16_weight ? weight.data_ptr<float>() : nullptr;
  SHARDIT_PROFILE_SCOPE("fused rms_norm");
  at::parallel_for(0, rows.count(), grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (w32 != nullptr) {
        k.rms_norm_row_bf16_f32w(in + rows.offset(r), result + r * n, w32, n, epsilon);
      } else {
        k.rms_norm_row_bf16(in + rows.offset(r), result + r * n, w16, n, epsilon);
      }
    }
  });
  return true;
}

bool try_layer_norm_modulate(const at::Tensor& x, double eps, const at::Tensor& shift, const at::Tensor& scale,
                             at::Tensor& out) {
  const FusedKernelTable& k = kernels();
  const auto is_bf16_rows = [&](const at::Tensor& t) {
    return on_cpu(t) && t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.size(0) == x.size(0) &&
           t.size(1) == x.size(-1) && t.stride(1) == 1;
  };
  if (k.layer_norm_modulate_row_bf16 == nullptr || !on_cpu(x) || x.scalar_type() != at::kBFloat16 || x.dim() < 2 ||
      x.size(-1) == 0 || x.stride(-1) != 1 || !is_bf16_rows(shift) || !is_bf16_rows(scale)) {
    return false;
  }
  // 1 + scale rounded to bf16, as diffusers' bf16 (1 + scale) is. [B, D]
  const at::Tensor scale1 = (1 + scale).contiguous();
  const at::Tensor shift_c = shift.contiguous();
  out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1);
  const Rows rows(x);
  const auto* in = x.data_ptr<at::BFloat16>();
  auto* result = out.data_ptr<at::BFloat16>();
  const auto* scale1_data = scale1.data_ptr<at::BFloat16>();
  const auto* shift_data = shift_c.data_ptr<at::BFloat16>();
  const float epsilon = static_cast<float>(eps);
  SHARDIT_PROFILE_SCOPE("fused layer_norm_modulate");
  at::parallel_for(0, rows.count(), grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t batch = 0;
      const int64_t offset = rows.offset(r, &batch, /*dim=*/0);
      k.layer_norm_modulate_row_bf16(in + offset, result + r * n, scale1_data + batch * n, shift_data + batch * n, n,
                                     epsilon);
    }
  });
  return true;
}

bool try_rope_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out) {
  const FusedKernelTable& k = kernels();
  if (k.rope_interleaved_row_f32 == nullptr || !on_cpu(x) || !on_cpu(out) || !on_cpu(cos) || !on_cpu(sin) ||
      x.dim() != 4 || out.sizes() != x.sizes() || out.scalar_type() != x.scalar_type() || x.stride(3) != 1 ||
      out.stride(3) != 1 || x.size(3) % 2 != 0 || cos.scalar_type() != at::kFloat ||
      sin.scalar_type() != at::kFloat || cos.dim() != 2 || cos.size(0) != x.size(1) || cos.size(1) != x.size(3) ||
      sin.sizes() != cos.sizes() || (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16)) {
    return false;
  }
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const int64_t n = x.size(3);
  const Rows in_rows(x), out_rows(out);
  const float* cos_data = cos_c.data_ptr<float>();
  const float* sin_data = sin_c.data_ptr<float>();
  SHARDIT_PROFILE_SCOPE("fused rope");
  at::parallel_for(0, in_rows.count(), grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t position = 0;
      const int64_t in_offset = in_rows.offset(r, &position, /*dim=*/1);
      const int64_t out_offset = out_rows.offset(r);
      if (x.scalar_type() == at::kBFloat16) {
        k.rope_interleaved_row_bf16(x.data_ptr<at::BFloat16>() + in_offset, out.data_ptr<at::BFloat16>() + out_offset,
                                    cos_data + position * n, sin_data + position * n, n);
      } else {
        k.rope_interleaved_row_f32(x.data_ptr<float>() + in_offset, out.data_ptr<float>() + out_offset,
                                   cos_data + position * n, sin_data + position * n, n);
      }
    }
  });
  return true;
}

bool try_softmax_rows(const at::Tensor& scores, const at::Tensor& key_mask, double scale, bool normalize,
                      at::Tensor& probs, at::Tensor& row_max, at::Tensor& row_sum) {
  const FusedKernelTable& k = kernels();
  if (k.softmax_row_f32 == nullptr || !on_cpu(scores) || scores.dim() != 2 || !scores.is_contiguous() ||
      (scores.scalar_type() != at::kFloat && scores.scalar_type() != at::kBFloat16) || !(scale > 0.0) ||
      !std::isfinite(scale)) {
    return false;
  }
  const int64_t nq = scores.size(0), nk = scores.size(1);
  int64_t mask_row_stride = 0;
  if (key_mask.defined()) {
    if (!on_cpu(key_mask) || key_mask.scalar_type() != at::kBool || key_mask.dim() != 2 ||
        key_mask.size(1) != nk || key_mask.stride(1) != 1 || (key_mask.size(0) != nq && key_mask.size(0) != 1)) {
      return false;
    }
    mask_row_stride = key_mask.size(0) == 1 ? 0 : key_mask.stride(0);
  }
  if (!(probs.defined() && probs.is_same(scores))) probs = at::empty({nq, nk}, scores.options());
  const auto float_options = scores.options().dtype(at::kFloat);
  row_max = at::empty({nq}, float_options);
  row_sum = at::empty({nq}, float_options);
  const bool* mask = key_mask.defined() ? key_mask.data_ptr<bool>() : nullptr;
  float* maxima = row_max.data_ptr<float>();
  float* sums = row_sum.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  SHARDIT_PROFILE_SCOPE("fused softmax");
  at::parallel_for(0, nq, grain_rows(nk), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(64);  // a vector's lanes (16 floats in AVX-512)
    for (int64_t r = begin; r < end; ++r) {
      const bool* mask_row = mask == nullptr ? nullptr : mask + r * mask_row_stride;
      if (scores.scalar_type() == at::kBFloat16) {
        k.softmax_row_bf16(scores.data_ptr<at::BFloat16>() + r * nk, mask_row, nk, scale_f, normalize,
                           probs.data_ptr<at::BFloat16>() + r * nk, maxima + r, sums + r, scratch.data());
      } else {
        k.softmax_row_f32(scores.data_ptr<float>() + r * nk, mask_row, nk, scale_f, normalize,
                          probs.data_ptr<float>() + r * nk, maxima + r, sums + r, scratch.data());
      }
    }
  });
  return true;
}

}  // namespace shardit::nn::cpu
