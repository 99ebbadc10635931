#pragma once
// The "amx" attention backend: bf16 attention in one kernel on AMX tiles (nn/cpu/amx_attention.h),
// where the CPU has them and the GEMM selection (nn/gemm.h) lets bf16 products leave at::linear.
// "auto" prefers it on CPU for the calls it takes; ring attention's partial results use it too.
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "shardit/nn/attention/memory_efficient.h"

namespace shardit::nn {

/// "" when the AMX attention runs this call (the arguments of memory_efficient_attention),
/// otherwise why not: bf16 CPU q, k, v [B, H, S, D] with D a multiple of 32, no mask or a bool
/// one, a finite positive scale, AMX available, and --gemm-backend auto or amx.
std::string amx_attention_refusal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& mask, double scale);

/// softmax(q k^T * scale + mask) v and each query's log-sum-exp, as memory_efficient_attention
/// returns them, on the AMX kernel; an error with amx_attention_refusal's reason where it does not
/// run the call.
AttentionWithLse amx_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& mask, double scale);

/// The attention with its log-sum-exp on the kernel the attention selection implies: amx_attention
/// under "auto" or "amx" where it runs the call, memory_efficient_attention otherwise.
AttentionWithLse attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, double scale);

}  // namespace shardit::nn
