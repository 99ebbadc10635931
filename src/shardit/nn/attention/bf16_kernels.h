#pragma once
// The "amx" and "avx512_bf16" attention backends: bf16 attention in one kernel
// (nn/cpu/bf16_attention.h), its products on AMX tiles or on AVX512-BF16's pair dot products,
// where the CPU has them and the GEMM selection (nn/gemm.h) lets bf16 products leave the library.
// "auto" prefers them on CPU, amx first, for the calls they take; ring attention's partial results
// use them too.
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "shardit/nn/attention/memory_efficient.h"
#include "shardit/nn/cpu/bf16_attention_kernel.h"

namespace shardit::nn {

/// "" when `kernel` runs this call (the arguments of memory_efficient_attention), otherwise why
/// not: bf16 CPU q, k, v [B, H, S, D] with D a multiple of 32, no mask or a bool one, a finite
/// positive scale, the kernel available, and --gemm-backend auto or amx (blas and onednn keep
/// every bf16 product in the libraries).
std::string bf16_kernel_attention_refusal(cpu::Bf16AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const std::optional<at::Tensor>& mask, double scale);

/// softmax(q k^T * scale + mask) v and each query's log-sum-exp, as memory_efficient_attention
/// returns them, on `kernel`; an error with bf16_kernel_attention_refusal's reason where it does
/// not run the call.
AttentionWithLse bf16_kernel_attention(cpu::Bf16AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const std::optional<at::Tensor>& mask, double scale);

/// The backend that bf16 attention on the CPU runs on under the current selections, for the calls
/// the bf16 kernels take (head sizes that are multiples of 32, no additive mask): "amx",
/// "avx512_bf16" or "memory_efficient" under "auto"; the selected backend otherwise. For start-up
/// lines and the bench.
std::string cpu_bf16_attention_backend();

/// The attention with its log-sum-exp on the kernel the attention selection implies: under "auto"
/// amx, then avx512_bf16, where they run the call; under "amx" or "avx512_bf16" that kernel where
/// it runs the call; memory_efficient_attention otherwise.
AttentionWithLse attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, double scale);

}  // namespace shardit::nn
