#pragma once
// Fused CPU kernels for the element-wise work around the products: GELU(tanh) in place, RMSNorm,
// interleaved rotary embedding and the attention's softmax. Each reads and writes its tensors
// once, computes in fp32 and rounds once to the output's dtype, where LibTorch 1.13 runs several
// passes with temporaries (and bf16 through scalar loops): in bf16 they were a third of a FLUX
// step on CPU (docs/benchmarks.md).
//
// The kernel build (AVX512-BF16, AVX-512, AVX2 or portable) is the best the instruction-set
// dispatch allows (dispatch.h: this CPU, capped by SHARDIT_CPU_ISA), chosen once per process;
// every row is computed by one thread in a fixed order. So the same inputs give the same bits on
// the same machine whatever its load or thread count. FusedKernelsScope runs another build, or
// none (LibTorch's operators), to compare.
//
// Each try_* returns false, having done nothing, for what it does not take (another device or
// dtype, a layout it does not read, kernels off); the caller then runs LibTorch's operators.
#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace shardit::nn::cpu {

/// "avx512_bf16", "avx512", "avx2", "default" (the build the process runs), or "off".
const char* fused_kernels_name();

/// False while a FusedKernelsScope("off") lives.
bool fused_kernels_enabled();

/// The builds the kernels may run here, best first ("avx512_bf16", "avx512", "avx2", "default"),
/// then "off": the values FusedKernelsScope takes (the process runs the first).
std::vector<std::string> fused_kernel_builds();

/// Runs the process on another build while it lives (process-wide, for tests and benchmarks that
/// compare builds on one machine; not for concurrent use). An error names the runnable builds.
class FusedKernelsScope {
 public:
  explicit FusedKernelsScope(const std::string& build);
  ~FusedKernelsScope();
  FusedKernelsScope(const FusedKernelsScope&) = delete;
  FusedKernelsScope& operator=(const FusedKernelsScope&) = delete;

 private:
  const void* previous_;
};

/// x = gelu(x, approximate="tanh") in place; x contiguous bf16 on the CPU.
bool try_gelu_tanh_(const at::Tensor& x);

/// RMSNorm of bf16 rows (the last dimension contiguous) with an optional bf16 or fp32 weight,
/// into a new contiguous tensor `out`.
bool try_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);

/// modulate(layer_norm(x), shift, scale) of bf16 x [B, ..., D] (D contiguous) with bf16 shift and
/// scale [B, D] (D contiguous), into a new contiguous `out`; the roundings of diffusers' bf16 ops.
bool try_layer_norm_modulate(const at::Tensor& x, double eps, const at::Tensor& shift, const at::Tensor& scale,
                             at::Tensor& out);

/// Interleaved rotary embedding of x [B, S, H, D] (fp32 or bf16, D contiguous) with fp32 tables
/// cos, sin [S, D], written into out (x's shape and dtype, any strides with D contiguous).
bool try_rope_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out);

/// The attention weights of a block of scores [nq, nk] (fp32 or bf16, contiguous):
/// exp(scale * (s - rowmax)), masked keys 0, divided by the row's sum when `normalize`.
/// `key_mask`: undefined, or bool [nq or 1, nk] (true = attend); `scale` finite and > 0.
/// Returns false for anything else. Outputs: probs [nq, nk] in the scores' dtype (in place when
/// passed in as `scores` itself, else allocated), row_max [nq] fp32 (scaled; -inf for a fully
/// masked row), row_sum [nq] fp32.
bool try_softmax_rows(const at::Tensor& scores, const at::Tensor& key_mask, double scale, bool normalize,
                      at::Tensor& probs, at::Tensor& row_max, at::Tensor& row_sum);

}  // namespace shardit::nn::cpu
