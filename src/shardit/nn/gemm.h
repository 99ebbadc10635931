#pragma once
// The matrix products of nn's layers (Linear, its LoRA deltas, the attention products) and the
// kernel that computes them on CPU: LibTorch's BLAS path (at::linear / addmm / bmm, i.e. the BLAS
// LibTorch was linked with), oneDNN through ATen's mkldnn ops (where LibTorch was built with it),
// or, for bf16 Linears on CPUs with AMX, shardit's own tile kernel (nn/cpu/amx_gemm.h).
//
// Why a choice: the BLAS library picks its kernels from the CPU it recognises at start-up. Debian
// 12's OpenBLAS does not recognise some current Xeons (it names them "Prescott" and runs SSE3
// kernels), which makes an fp32 GEMM 3-4x slower than the CPU allows, while oneDNN finds the
// AVX-512 kernels itself. Where BLAS recognises the CPU it can be the faster of the two. "auto"
// decides from what the machine is, never from a timing (a race run under load would make the
// kernel, and so the last bits of every result, depend on the load): oneDNN when the BLAS
// library's kernels use a narrower vector set than the CPU has (its core name against cpuid),
// BLAS otherwise. For bf16, LibTorch sends at::linear to oneDNN itself; "auto" sends the large
// bf16 Linears to the AMX kernel where the CPU has AMX-BF16 (faster than LibTorch 1.13's oneDNN on
// them), the rest stays on at::linear.
#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace shardit::nn {

enum class GemmBackend { Auto, Blas, OneDnn, Amx };

/// "auto", "blas", "onednn" or "amx"; an error listing them otherwise, when oneDNN is asked for and
/// the linked LibTorch was built without it, or when amx is asked for where the AMX kernel cannot
/// run (the error says why). amx: every bf16 Linear whose widths the kernel takes goes to it, at
/// any size; fp32 products as under auto. blas and onednn keep bf16 Linears on at::linear.
GemmBackend parse_gemm_backend(const std::string& name);
const char* gemm_backend_name(GemmBackend backend);

/// Selects the kernel for every following product (process-wide). The start value is "auto", or
/// SHARDIT_GEMM_BACKEND from the environment.
void set_gemm_backend(GemmBackend backend);
GemmBackend gemm_backend_selection();

/// Sets a selection for the lifetime of the guard and restores the previous one after.
class GemmBackendGuard {
 public:
  explicit GemmBackendGuard(GemmBackend backend) : previous_(gemm_backend_selection()) { set_gemm_backend(backend); }
  ~GemmBackendGuard() { set_gemm_backend(previous_); }
  GemmBackendGuard(const GemmBackendGuard&) = delete;
  GemmBackendGuard& operator=(const GemmBackendGuard&) = delete;

 private:
  GemmBackend previous_;
};

/// The rates of both kernels on this process for one thread count, for reports (the bench): auto
/// does not read them.
struct GemmProbe {
  int threads = 0;
  double blas_gflops = 0;    ///< fp32 [512, 1024] x [1024, 1024] + bias through at::linear
  double onednn_gflops = 0;  ///< the same through at::mkldnn_linear (0: oneDNN not available)
};

/// Runs (once per thread count, then cached) and returns the probe for the current thread count.
GemmProbe gemm_probe();

/// What "auto" takes for large fp32 products on CPU: OneDnn when oneDNN is built in and the BLAS
/// kernels' vector set is known and narrower than the one the kernels may use (cpu/blas_core.h,
/// cpu/dispatch.h), else Blas. The same on every run of a build on a machine.
GemmBackend auto_gemm_backend();

/// One line for start-up messages and the bench: "blas (auto; BLAS core Haswell; cpu avx2 fma ...;
/// bf16 Linears on at::linear)".
std::string gemm_kernel_summary();

/// The kernel that a product of `rows` rows of `dtype` on `device` goes to under the current
/// selection: Blas or OneDnn. Off CPU, for dtypes other than fp32, and for products too small to
/// gain (auto: fewer than 64 rows, or under 2^22 multiply-adds) this is Blas.
GemmBackend gemm_backend_for(const at::Device& device, at::ScalarType dtype, int64_t rows, int64_t weight_numel);

/// Whether a bf16 Linear x [rows, in] w [out, in]^T on `device` goes to the AMX kernel under the
/// current selection. auto: the CPU runs the kernel, in and out are multiples of 32 and at least
/// 256, and more than 512 rows (measured against oneDNN: behind at 256 and 512 rows, 1.05-1.25x
/// from 520; behind at 64 rows or 64 outputs). amx: whenever the kernel runs here and takes the widths.
bool linear_on_amx(const at::Device& device, at::ScalarType dtype, int64_t rows, int64_t in, int64_t out);

/// at::linear's contract: x [..., in], weight [out, in], bias [out] (undefined: none) ->
/// [..., out], on the selected kernel.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

/// Batched a b^T on the selected kernel: a [G, M, K], b [G, N, K] -> [G, M, N] (at::bmm(a,
/// b.transpose(1, 2)) on BLAS). Both may be strided views (e.g. heads of [B, S, H, D]).
at::Tensor bmm_nt(const at::Tensor& a, const at::Tensor& b);

/// Batched a b on the selected kernel: a [G, M, K], b [G, K, N] -> [G, M, N].
at::Tensor bmm_nn(const at::Tensor& a, const at::Tensor& b);

}  // namespace shardit::nn
