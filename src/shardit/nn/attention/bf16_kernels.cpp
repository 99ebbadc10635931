#include "shardit/nn/attention/bf16_kernels.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "shardit/nn/attention/backends.h"
#include "shardit/nn/cpu/bf16_attention.h"
#include "shardit/nn/gemm.h"

namespace shardit::nn {

std::string bf16_kernel_attention_refusal(cpu::Bf16AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const std::optional<at::Tensor>& mask, double scale) {
  if (!q.device().is_cpu() || q.scalar_type() != at::kBFloat16) return "it takes bf16 on the CPU";
  const std::string unavailable = cpu::bf16_attention_kernel_unavailable_reason(kernel);
  if (!unavailable.empty()) return unavailable;
  const GemmBackend selected = gemm_backend_selection();
  if (selected != GemmBackend::Auto && selected != GemmBackend::Amx) {
    return std::string("--gemm-backend ") + gemm_backend_name(selected) + " keeps bf16 products on at::linear";
  }
  std::optional<at::Tensor> mask4;
  if (mask.has_value() && mask->defined()) {
    if (mask->scalar_type() != at::kBool) return "it takes a bool mask or none, not an additive one";
    mask4 = attention_mask_4d(*mask, q, k);
    if (!mask4) return "its mask " + c10::str(mask->sizes()) + " does not broadcast to [B, H, S_q, S_kv]";
  }
  if (!cpu::bf16_attention_takes(kernel, q, k, v, mask4, scale)) {
    return "it takes q, k, v [B, H, S, D] with D a multiple of 32 and the last dimension contiguous, the keys of "
           "a mask contiguous, and a finite positive scale (got q " +
           c10::str(q.sizes()) + ", k " + c10::str(k.sizes()) + ", v " + c10::str(v.sizes()) + ", scale " +
           c10::str(scale) + ")";
  }
  return "";
}

AttentionWithLse bf16_kernel_attention(cpu::Bf16AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const std::optional<at::Tensor>& mask, double scale) {
  const std::string refusal = bf16_kernel_attention_refusal(kernel, q, k, v, mask, scale);
  TORCH_CHECK(refusal.empty(), cpu::bf16_attention_kernel_name(kernel), " attention: cannot run this call: ", refusal);
  std::optional<at::Tensor> mask4;
  if (mask.has_value() && mask->defined()) mask4 = attention_mask_4d(*mask, q, k);
  const int64_t batch = q.size(0), heads = q.size(1), s_q = q.size(2), head_dim = v.size(3);
  // [B, S_q, H, D] storage seen as [B, H, S_q, D], as memory_efficient_attention's: the callers'
  // transpose back to [B, S_q, H * D] is then a view.
  AttentionWithLse result;
  result.output = at::empty({batch, s_q, heads, head_dim}, q.options()).transpose(1, 2);
  result.lse = at::empty({batch, heads, s_q}, q.options().dtype(at::kFloat));
  cpu::bf16_attention(kernel, q, k, v, mask4, scale, result.output, result.lse);
  return result;
}

std::string cpu_bf16_attention_backend() {
  const std::string selection = attention_backend_selection();
  if (selection != "auto") return selection;
  const GemmBackend gemm = gemm_backend_selection();
  if (gemm != GemmBackend::Auto && gemm != GemmBackend::Amx) return "memory_efficient";
  for (const cpu::Bf16AttentionKernel kernel : {cpu::Bf16AttentionKernel::amx, cpu::Bf16AttentionKernel::avx512_bf16}) {
    if (cpu::bf16_attention_kernel_unavailable_reason(kernel).empty()) return cpu::bf16_attention_kernel_name(kernel);
  }
  return "memory_efficient";
}

AttentionWithLse attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, double scale) {
  const std::string selection = attention_backend_selection();
  for (const cpu::Bf16AttentionKernel kernel : {cpu::Bf16AttentionKernel::amx, cpu::Bf16AttentionKernel::avx512_bf16}) {
    if ((selection == "auto" || selection == cpu::bf16_attention_kernel_name(kernel)) &&
        bf16_kernel_attention_refusal(kernel, q, k, v, mask, scale).empty()) {
      return bf16_kernel_attention(kernel, q, k, v, mask, scale);
    }
  }
  return memory_efficient_attention(q, k, v, mask, scale);
}

}  // namespace shardit::nn
