#pragma once
// shardit's bf16 attention on AMX tiles: per head and block of 32 queries, the scores against
// every key on the tiles (fp32), the softmax of each row whole on the vector units (fp32), the
// bf16 weights times the values on the tiles, one division and one rounding to bf16.
//
// Why: on the memory-efficient path a head's bf16 scores ([1536, 1536], 4.5 MiB) leave the
// core's L2 between the product that writes them, the two softmax passes and the product that
// reads them, and each product is a oneDNN call of its own. Here a block's scores (32 rows) and
// weights stay in L2, the keys and values are laid out once per head in the tiles' pair layout,
// and q, k and v are read in place from the transformers' [B, S, H, D] layout.
//
// Numerics: scores in fp32 (the memory-efficient path rounds them to bf16), weights rounded to
// bf16 before the product with the values (as there), the product's sums in fp32, divided by
// the row's fp32 sum and rounded once. Each row's result depends on its own inputs only, in one
// fixed order: the same bits whatever the thread count, the split of the rows or the load.
#include <ATen/ATen.h>

#include <optional>

namespace shardit::nn::cpu {

/// Whether amx_attention computes this call: bf16 CPU q [B, H, S_q, D], k and v [B, H, S_kv, D]
/// with the last dimension contiguous and even row strides, D a multiple of 32, no mask or a
/// bool one broadcastable to [B, H, S_q, S_kv] with the keys contiguous, a finite scale > 0,
/// and the AMX kernels available.
bool amx_attention_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask4, double scale);

/// Writes softmax(scale q k^T + mask) v into `output` ([B, H, S_q, D] bf16, any strides with D
/// contiguous) and the rows' log-sum-exp into `lse` ([B, H, S_q] fp32, S_q contiguous); a fully
/// masked row gives 0 and -inf. mask4: a bool mask of 4 dimensions as above. Needs
/// amx_attention_takes; an error names what does not fit.
void amx_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& mask4, double scale, const at::Tensor& output,
                   const at::Tensor& lse);

}  // namespace shardit::nn::cpu
