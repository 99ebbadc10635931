#pragma once
// shardit's bf16 attention in one kernel: per head and block of 32 queries, the scores against a
// chunk of keys (fp32 sums), the softmax of each row whole on the vector units (fp32), the bf16
// weights times the values (fp32 sums), the chunks merged by the online softmax, one division and
// one rounding to bf16. The products run on AMX tiles (Bf16AttentionKernel::amx, Intel's Sapphire
// Rapids and later) or on AVX512-BF16's pair dot products (avx512_bf16: AMD's Zen 4 and later).
//
// Why: on the memory-efficient path a head's bf16 scores ([1536, 1536], 4.5 MiB) leave the
// core's L2 between the product that writes them, the two softmax passes and the product that
// reads them, and each product is a oneDNN call of its own on a shape it runs slowly (a depth or
// width of 128). Here a block's scores (32 rows) and weights stay in L2, the keys and values are
// laid out once per head in the pair layout of the products, and q, k and v are read in place from
// the transformers' [B, S, H, D] layout.
//
// Numerics: scores in fp32 (the memory-efficient path rounds them to bf16), weights rounded to
// bf16 before the product with the values (as there), the product's sums in fp32, divided by
// the row's fp32 sum and rounded once. Each row's result depends on its own inputs only, in one
// fixed order per kernel: the same bits whatever the thread count, the split of the rows or the
// load. The two kernels sum in different orders, so their last bits differ.
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "shardit/nn/cpu/bf16_attention_kernel.h"

namespace shardit::nn::cpu {

/// "amx" or "avx512_bf16".
const char* bf16_attention_kernel_name(Bf16AttentionKernel kernel);

/// "" where this process can run `kernel` (the CPU has its instructions and the build has the
/// kernel), otherwise why not.
std::string bf16_attention_kernel_unavailable_reason(Bf16AttentionKernel kernel);

/// Whether bf16_attention computes this call on `kernel`: bf16 CPU q [B, H, S_q, D], k and v
/// [B, H, S_kv, D] with the last dimension contiguous and even row strides, D a multiple of 32, no
/// mask or a bool one broadcastable to [B, H, S_q, S_kv] with the keys contiguous, a finite
/// scale > 0, and the kernel available.
bool bf16_attention_takes(Bf16AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const std::optional<at::Tensor>& mask4, double scale);

/// Writes softmax(scale q k^T + mask) v into `output` ([B, H, S_q, D] bf16, any strides with D
/// contiguous) and the rows' log-sum-exp into `lse` ([B, H, S_q] fp32, S_q contiguous); a fully
/// masked row gives 0 and -inf. mask4: a bool mask of 4 dimensions as above. Needs
/// bf16_attention_takes; an error names what does not fit.
void bf16_attention(Bf16AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& mask4, double scale, const at::Tensor& output,
                    const at::Tensor& lse);

}  // namespace shardit::nn::cpu
