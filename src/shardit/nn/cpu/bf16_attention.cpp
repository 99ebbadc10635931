#include "shardit/nn/cpu/bf16_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "shardit/nn/cpu/dispatch.h"
#include "shardit/nn/cpu/amx_gemm.h"
#include "shardit/nn/cpu/growing_buffer.h"

namespace shardit::nn::cpu {

namespace {

bool bf16_rows(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.scalar_type() == at::kBFloat16 &&
         t.dim() == 4 && t.stride(3) == 1 && t.stride(2) % 2 == 0;
}

struct AttentionThreadScratch {
  GrowingBuffer packed_k, packed_v, scores, probs, sums, rows, merged, merged_max, merged_sum;
};

const uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

}  // namespace

const char* bf16_attention_kernel_name(Bf16AttentionKernel kernel) {
  return kernel == Bf16AttentionKernel::amx ? "amx" : "avx512_bf16";
}

std::string bf16_attention_kernel_unavailable_reason(Bf16AttentionKernel kernel) {
  if (kernel == Bf16AttentionKernel::amx) return amx_gemm_available() ? "" : amx_gemm_unavailable_reason();
  if (!avx512_bf16_attention_kernel_built()) return "this build has no AVX512-BF16 kernels (the compiler lacked -mavx512bf16)";
  return cpu_isa_refusal(CpuIsa::Avx512Bf16);
}

bool bf16_attention_takes(Bf16AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const std::optional<at::Tensor>& mask4, double scale) {
  if (!bf16_rows(q) || !bf16_rows(k) || !bf16_rows(v)) return false;
  const int64_t head_dim = q.size(3);
  if (head_dim == 0 || head_dim % 32 != 0 || k.size(3) != head_dim || v.size(3) != head_dim) return false;
  if (k.size(0) != q.size(0) || v.size(0) != q.size(0) || k.size(1) != q.size(1) || v.size(1) != q.size(1) ||
      v.size(2) != k.size(2)) {
    return false;
  }
  if (mask4) {
    const at::Tensor& m = *mask4;
    if (m.scalar_type() != at::kBool || m.dim() != 4 || m.size(3) != k.size(2) || m.stride(3) != 1) return false;
    // Broadcast over batch, heads and queries, or one per each.
    for (int64_t d = 0; d < 3; ++d) {
      if (m.size(d) != 1 && m.size(d) != q.size(d)) return false;
    }
  }
  return scale > 0.0 && std::isfinite(scale) && bf16_attention_kernel_unavailable_reason(kernel).empty();
}

void bf16_attention(Bf16AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& mask4, double scale, const at::Tensor& output,
                    const at::Tensor& lse) {
  const std::string unavailable = bf16_attention_kernel_unavailable_reason(kernel);
  TORCH_CHECK(bf16_attention_takes(kernel, q, k, v, mask4, scale), "bf16_attention (", bf16_attention_kernel_name(kernel),
              "): q ", q.sizes(), " ", q.scalar_type(),
              ", k ", k.sizes(), ", v ", v.sizes(), mask4 ? ", mask " + c10::str(mask4->sizes()) : std::string(),
              ", scale ", scale,
              " is not a call the kernel takes (bf16 CPU [B, H, S, D] rows, D a multiple of 32, a bool mask or "
              "none, a finite positive scale; the kernel: ",
              unavailable.empty() ? std::string("available") : unavailable, ")");
  const int64_t batch = q.size(0), heads = q.size(1), s_q = q.size(2), s_kv = k.size(2), head_dim = q.size(3);
  TORCH_CHECK(output.scalar_type() == at::kBFloat16 && output.dim() == 4 && output.size(0) == batch &&
                  output.size(1) == heads && output.size(2) == s_q && output.size(3) == head_dim &&
                  output.stride(3) == 1,
              "bf16_attention: output ", output.sizes(), " ", output.scalar_type(), " must be bf16 [", batch, ", ",
              heads, ", ", s_q, ", ", head_dim, "] with its last dimension contiguous");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == heads &&
                  lse.size(2) == s_q && lse.stride(2) == 1,
              "bf16_attention: lse ", lse.sizes(), " ", lse.scalar_type(), " must be fp32 [", batch, ", ", heads, ", ",
              s_q, "] with its last dimension contiguous");
  if (s_q == 0 || batch == 0 || heads == 0) return;
  if (s_kv == 0) {
    // No keys: every query is fully masked.
    output.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return;
  }
  const int64_t padded = attention_padded_keys(s_kv);
  const Bf16AttentionBlocking blocking = attention_blocking(kernel);
  const bool on_amx = kernel == Bf16AttentionKernel::amx;

  // Tasks: (batch, head, run of 32-row blocks); a head splits into runs only when there are fewer
  // heads than two per thread (the keys and values are laid out again for each run).
  const int64_t head_count = batch * heads;
  const int64_t row_blocks = (s_q + 31) / 32;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t runs = std::min(row_blocks, std::max<int64_t>(1, (2 * threads + head_count - 1) / head_count));
  const int64_t blocks_per_run = (row_blocks + runs - 1) / runs;

  const uint16_t* q_bits = bf16_bits(q);
  const uint16_t* k_bits = bf16_bits(k);
  const uint16_t* v_bits = bf16_bits(v);
  uint16_t* out_bits = reinterpret_cast<uint16_t*>(output.data_ptr<at::BFloat16>());
  float* lse_data = lse.data_ptr<float>();
  const bool* mask_data = mask4 ? mask4->data_ptr<bool>() : nullptr;
  at::parallel_for(0, head_count * runs, 1, [&](int64_t begin, int64_t end) {
    static thread_local AttentionThreadScratch buffers;
    Bf16AttentionScratch scratch;
    const size_t layout_bytes = sizeof(uint16_t) * static_cast<size_t>(padded * head_dim);
    const size_t chunk = static_cast<size_t>(attention_chunk_keys(s_kv, blocking)),
                 group_rows = static_cast<size_t>(32 * blocking.row_group);
    scratch.packed_k = static_cast<uint32_t*>(buffers.packed_k.get(layout_bytes, "bf16_attention"));
    scratch.packed_v = static_cast<uint32_t*>(buffers.packed_v.get(layout_bytes, "bf16_attention"));
    scratch.scores = static_cast<float*>(buffers.scores.get(sizeof(float) * 32 * chunk, "bf16_attention"));
    scratch.probs = static_cast<uint16_t*>(buffers.probs.get(sizeof(uint16_t) * 2 * 32 * chunk, "bf16_attention"));
    scratch.sums = static_cast<float*>(buffers.sums.get(sizeof(float) * 32 * head_dim, "bf16_attention"));
    scratch.rows = static_cast<uint16_t*>(buffers.rows.get(sizeof(uint16_t) * 32 * head_dim, "bf16_attention"));
    scratch.merged = static_cast<float*>(buffers.merged.get(sizeof(float) * group_rows * head_dim, "bf16_attention"));
    scratch.merged_max = static_cast<float*>(buffers.merged_max.get(sizeof(float) * group_rows, "bf16_attention"));
    scratch.merged_sum = static_cast<float*>(buffers.merged_sum.get(sizeof(float) * group_rows, "bf16_attention"));
    int64_t laid_out = -1;  // the (batch, head) whose keys and values the buffers hold
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head_index = task / runs, run = task % runs;
      const int64_t q_begin = run * blocks_per_run * 32;
      const int64_t q_end = std::min(s_q, q_begin + blocks_per_run * 32);
      if (q_begin >= q_end) continue;
      const int64_t b = head_index / heads, h = head_index % heads;
      Bf16AttentionArgs args;
      args.q = q_bits + b * q.stride(0) + h * q.stride(1);
      args.q_stride = q.stride(2);
      args.k = k_bits + b * k.stride(0) + h * k.stride(1);
      args.k_stride = k.stride(2);
      args.v = v_bits + b * v.stride(0) + h * v.stride(1);
      args.v_stride = v.stride(2);
      if (mask_data != nullptr) {
        const at::Tensor& m = *mask4;
        args.mask = mask_data + (m.size(0) == 1 ? 0 : b * m.stride(0)) + (m.size(1) == 1 ? 0 : h * m.stride(1));
        args.mask_stride = m.size(2) == 1 ? 0 : m.stride(2);
      }
      args.out = out_bits + b * output.stride(0) + h * output.stride(1);
      args.out_stride = output.stride(2);
      args.lse = lse_data + b * lse.stride(0) + h * lse.stride(1);
      args.s_q = s_q;
      args.s_kv = s_kv;
      args.head_dim = head_dim;
      args.scale = static_cast<float>(scale);
      if (laid_out != head_index) {
        if (on_amx) {
          amx_attention_pack(args, scratch);
        } else {
          avx512_bf16_attention_pack(args, scratch);
        }
        laid_out = head_index;
      }
      if (on_amx) {
        amx_attention_rows(args, q_begin, q_end, scratch);
      } else {
        avx512_bf16_attention_rows(args, q_begin, q_end, scratch);
      }
    }
  });
}

}  // namespace shardit::nn::cpu
