#include "shardit/nn/gemm.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>

#include "shardit/nn/cpu/amx_gemm.h"
#include "shardit/nn/cpu/blas_core.h"
#include "shardit/nn/cpu/dispatch.h"

namespace shardit::nn {

namespace {

// auto routes a product to oneDNN only from this size on: below it the conversions to and from
// oneDNN's tensors cost more than the kernel gains (measured at 3072 x 3072 weights: BLAS ahead
// at 1-2 rows, level at 64, oneDNN 2.3x ahead at 256). The bound on multiply-adds keeps tiny
// layers (and the test models) on BLAS while a block of one attention head (a few hundred queries
// x the keys x 128) qualifies.
constexpr int64_t kMinRows = 64;
constexpr int64_t kMinMultiplyAdds = int64_t{1} << 22;
// auto's bounds for bf16 Linears on the AMX kernel (nn/cpu/amx_gemm.h), measured against oneDNN
// with 2 threads on 3072-wide products: oneDNN ahead at 256 and 512 rows (its blocks fit those
// exactly), the kernel ahead from 520 rows on (1.05-1.25x up to 800, 1.03-1.26x beyond); behind
// at 64 rows, and at 64 outputs (too few column blocks to share between threads).
constexpr int64_t kAmxMinRows = 513;
constexpr int64_t kAmxMinWidth = 256;

bool onednn_available() { return at::hasMKLDNN(); }

GemmBackend initial_selection() {
  const char* env = std::getenv("SHARDIT_GEMM_BACKEND");
  if (env == nullptr || *env == '\0') return GemmBackend::Auto;
  return parse_gemm_backend(env);
}

std::atomic<GemmBackend>& selection() {
  static std::atomic<GemmBackend> value{initial_selection()};
  return value;
}

double seconds_of(const std::function<void()>& work) {
  const auto start = std::chrono::steady_clock::now();
  work();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

at::Tensor onednn_linear_2d(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& bias) {
  // The input goes into oneDNN's tensor (a copy), the weight and bias are read in place.
  c10::optional<at::Tensor> bias_opt;
  if (bias.defined()) bias_opt = bias.is_contiguous() ? bias : bias.contiguous();
  return at::mkldnn_linear(rows.contiguous().to_mkldnn(), weight.is_contiguous() ? weight : weight.contiguous(),
                           bias_opt)
      .to_dense();
}

GemmProbe run_probe(int threads) {
  GemmProbe probe;
  probe.threads = threads;
  // Shaped like a projection of a transformer block: 1 GFLOP, enough for both kernels to reach
  // their rate, a few to a few tens of milliseconds.
  constexpr int64_t rows = 512, in = 1024, out = 1024;
  // Constant operands: the kernels' speed does not depend on the values (none is denormal), and
  // the global random generator, which callers may have seeded, is left untouched.
  const at::Tensor x = at::full({rows, in}, 0.5f);
  const at::Tensor w = at::full({out, in}, 0.25f);
  const at::Tensor b = at::full({out}, 1.0f);
  const double flop = 2.0 * rows * in * out;
  double blas = 1e30, onednn = 1e30;
  at::linear(x, w, b);  // warm-up: thread pool, kernel selection
  if (onednn_available()) onednn_linear_2d(x, w, b);
  // Alternated, best of three each: the machine's speed may change while the probe runs.
  for (int i = 0; i < 3; ++i) {
    blas = std::min(blas, seconds_of([&] { at::linear(x, w, b); }));
    if (onednn_available()) onednn = std::min(onednn, seconds_of([&] { onednn_linear_2d(x, w, b); }));
  }
  probe.blas_gflops = flop / blas / 1e9;
  probe.onednn_gflops = onednn_available() ? flop / onednn / 1e9 : 0.0;
  return probe;
}

/// Whether this product of `dtype` on `device` could run on oneDNN at all.
bool routable(const at::Device& device, at::ScalarType dtype) {
  return device.is_cpu() && dtype == at::kFloat && onednn_available();
}

}  // namespace

GemmBackend parse_gemm_backend(const std::string& name) {
  if (name == "auto") return GemmBackend::Auto;
  if (name == "blas") return GemmBackend::Blas;
  if (name == "onednn") {
    TORCH_CHECK(onednn_available(), "gemm backend 'onednn': the linked LibTorch was built without oneDNN "
                                    "(MKLDNN); use blas or auto");
    return GemmBackend::OneDnn;
  }
  if (name == "amx") {
    TORCH_CHECK(cpu::amx_gemm_available(), "gemm backend 'amx': ", cpu::amx_gemm_unavailable_reason(),
                "; use auto, blas or onednn");
    return GemmBackend::Amx;
  }
  TORCH_CHECK(false, "unknown gemm backend '", name, "'; choose auto, blas, onednn or amx");
}

const char* gemm_backend_name(GemmBackend backend) {
  switch (backend) {
    case GemmBackend::Auto: return "auto";
    case GemmBackend::Blas: return "blas";
    case GemmBackend::OneDnn: return "onednn";
    case GemmBackend::Amx: return "amx";
  }
  return "?";
}

void set_gemm_backend(GemmBackend backend) {
  // Refuses what cannot run here.
  if (backend == GemmBackend::OneDnn || backend == GemmBackend::Amx) parse_gemm_backend(gemm_backend_name(backend));
  selection().store(backend);
}

GemmBackend gemm_backend_selection() { return selection().load(); }

GemmProbe gemm_probe() {
  static std::mutex mutex;
  static std::map<int, GemmProbe> probes;
  const int threads = at::get_num_threads();
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = probes.find(threads);
  if (it != probes.end()) return it->second;
  return probes.emplace(threads, run_probe(threads)).first->second;
}

GemmBackend auto_gemm_backend() {
  static const GemmBackend choice = [] {
    if (!onednn_available()) return GemmBackend::Blas;
    const int blas_level = cpu::blas_vector_level(cpu::blas_core_name());
    return blas_level > 0 && blas_level < cpu::cpu_vector_level() ? GemmBackend::OneDnn : GemmBackend::Blas;
  }();
  return choice;
}

std::string gemm_kernel_summary() {
  const GemmBackend selected = gemm_backend_selection();
  const GemmBackend large =
      selected == GemmBackend::Auto || selected == GemmBackend::Amx ? auto_gemm_backend() : selected;
  const std::string core = cpu::blas_core_name();
  const bool bf16_on_amx = linear_on_amx(at::kCPU, at::kBFloat16, 4096, 3072, 3072);
  return std::string(gemm_backend_name(large)) + (selected == GemmBackend::Auto ? " (auto" : " (set") +
         "; BLAS core " + (core.empty() ? std::string("unknown") : core) + "; kernels " + cpu::cpu_isa_summary() +
         "; bf16 Linears on " + (bf16_on_amx ? "amx" : "at::linear") + ")";
}

GemmBackend gemm_backend_for(const at::Device& device, at::ScalarType dtype, int64_t rows, int64_t weight_numel) {
  if (!routable(device, dtype)) return GemmBackend::Blas;
  switch (gemm_backend_selection()) {
    case GemmBackend::Blas: return GemmBackend::Blas;
    case GemmBackend::OneDnn: return rows > 0 ? GemmBackend::OneDnn : GemmBackend::Blas;
    case GemmBackend::Auto:
    case GemmBackend::Amx:  // amx routes bf16 Linears only (linear_on_amx); fp32 as auto
      if (rows < kMinRows || rows * weight_numel < kMinMultiplyAdds) return GemmBackend::Blas;
      return auto_gemm_backend();
  }
  return GemmBackend::Blas;
}

bool linear_on_amx(const at::Device& device, at::ScalarType dtype, int64_t rows, int64_t in, int64_t out) {
  if (!device.is_cpu() || dtype != at::kBFloat16 || rows <= 0 || !cpu::amx_gemm_takes(in, out)) return false;
  switch (gemm_backend_selection()) {
    case GemmBackend::Amx: return cpu::amx_gemm_available();
    case GemmBackend::Auto:
      return rows >= kAmxMinRows && in >= kAmxMinWidth && out >= kAmxMinWidth && cpu::amx_gemm_available();
    case GemmBackend::Blas:
    case GemmBackend::OneDnn: return false;
  }
  return false;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t in = x.size(-1);
  const int64_t rows = in == 0 ? 0 : x.numel() / in;
  if (weight.dim() == 2 && weight.size(1) == in && weight.scalar_type() == at::kBFloat16 &&
      (!bias.defined() || bias.scalar_type() == at::kBFloat16) &&
      linear_on_amx(x.device(), x.scalar_type(), rows, in, weight.size(0))) {
    return cpu::amx_linear(x, weight, bias);
  }
  if (gemm_backend_for(x.device(), x.scalar_type(), rows, weight.numel()) != GemmBackend::OneDnn ||
      weight.scalar_type() != at::kFloat || (bias.defined() && bias.scalar_type() != at::kFloat)) {
    return at::linear(x, weight, bias);
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  // [rows, in] -> [rows, out] -> [..., out]
  return onednn_linear_2d(x.reshape({rows, in}), weight, bias).view(sizes);
}

at::Tensor bmm_nt(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(2),
              "bmm_nt: expected a [G, M, K] and b [G, N, K], got ", a.sizes(), " and ", b.sizes());
  if (gemm_backend_for(a.device(), a.scalar_type(), a.size(1), b.size(1) * b.size(2)) != GemmBackend::OneDnn ||
      b.scalar_type() != at::kFloat) {
    return at::bmm(a, b.transpose(1, 2));
  }
  // [G, M, N]: one product per slice, b's slice as the "weight" [N, K].
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(1)}, a.options());
  for (int64_t g = 0; g < a.size(0); ++g) out.select(0, g).copy_(onednn_linear_2d(a.select(0, g), b.select(0, g), {}));
  return out;
}

at::Tensor bmm_nn(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
              "bmm_nn: expected a [G, M, K] and b [G, K, N], got ", a.sizes(), " and ", b.sizes());
  if (gemm_backend_for(a.device(), a.scalar_type(), a.size(1), b.size(1) * b.size(2)) != GemmBackend::OneDnn ||
      b.scalar_type() != at::kFloat) {
    return at::bmm(a, b);
  }
  // [G, M, N]: b's slice transposed ([N, K], a small copy) as the "weight".
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  for (int64_t g = 0; g < a.size(0); ++g) {
    out.select(0, g).copy_(onednn_linear_2d(a.select(0, g), b.select(0, g).t().contiguous(), {}));
  }
  return out;
}

}  // namespace shardit::nn
