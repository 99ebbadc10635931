#include "shardit/nn/cpu/amx_gemm.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <memory>

#include "shardit/nn/cpu/dispatch.h"
#include "shardit/nn/cpu/amx_gemm_kernel.h"
#include "shardit/nn/cpu/growing_buffer.h"

namespace shardit::nn::cpu {

namespace {

std::string unavailable_reason() {
  if (!amx_gemm_kernel_built()) return "this build has no AMX kernel (the compiler lacks -mamx-tile/-mamx-bf16)";
  return cpu_isa_refusal(CpuIsa::Amx);
}

const std::string& cached_reason() {
  static const std::string reason = unavailable_reason();
  return reason;
}

struct ThreadScratch {
  GrowingBuffer packed_w, sums, tail_rows;
};

const uint16_t* bits_of(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

/// The product of amx_linear and amx_linear_gelu_tanh (below).
at::Tensor amx_product(const std::vector<at::Tensor>& x_parts, const at::Tensor& weight, const at::Tensor& bias,
                       bool gelu_tanh);

}  // namespace

bool amx_gemm_available() { return cached_reason().empty(); }

std::string amx_gemm_unavailable_reason() { return cached_reason(); }

bool amx_gemm_takes(int64_t in, int64_t out) { return in > 0 && out > 0 && in % 32 == 0 && out % 32 == 0; }

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return amx_linear(std::vector<at::Tensor>{x}, weight, bias);
}

at::Tensor amx_linear_gelu_tanh(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return amx_product(std::vector<at::Tensor>{x}, weight, bias, /*gelu_tanh=*/true);
}

at::Tensor amx_linear(const std::vector<at::Tensor>& x_parts, const at::Tensor& weight, const at::Tensor& bias) {
  return amx_product(x_parts, weight, bias, /*gelu_tanh=*/false);
}

namespace {

at::Tensor amx_product(const std::vector<at::Tensor>& x_parts, const at::Tensor& weight, const at::Tensor& bias,
                       bool gelu_tanh) {
  TORCH_CHECK(amx_gemm_available(), "amx_linear: ", cached_reason());
  TORCH_CHECK(!x_parts.empty(), "amx_linear: no input");
  const at::Tensor& first = x_parts.front();
  TORCH_CHECK(weight.dim() == 2 && first.dim() >= 1 && (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0))),
              "amx_linear: x ", first.sizes(), ", weight ", weight.sizes(),
              bias.defined() ? ", bias " + c10::str(bias.sizes()) : std::string(), " do not make x w^T + b");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && (!bias.defined() || bias.scalar_type() == at::kBFloat16),
              "amx_linear: expected bf16 CPU tensors, got weight ", weight.scalar_type(),
              bias.defined() ? std::string(", bias ") + c10::toString(bias.scalar_type()) : std::string());
  const int64_t in = weight.size(1), out = weight.size(0);
  TORCH_CHECK(amx_gemm_takes(in, out), "amx_linear: weight ", weight.sizes(),
              " has widths the kernel does not take (in and out must be multiples of 32)");
  const at::IntArrayRef leading = first.sizes().slice(0, first.dim() - 1);
  std::vector<at::Tensor> rows2d;  // [rows, in_i] each, the last dimension contiguous
  int64_t width = 0;
  for (const at::Tensor& part : x_parts) {
    TORCH_CHECK(part.device().is_cpu() && part.scalar_type() == at::kBFloat16,
                "amx_linear: expected bf16 CPU tensors, got x ", part.scalar_type(), " on ", part.device());
    TORCH_CHECK(part.dim() == first.dim() && part.sizes().slice(0, part.dim() - 1) == leading &&
                    part.size(-1) % 32 == 0,
                "amx_linear: input blocks ", part.sizes(), " and ", first.sizes(),
                " must share their leading shape and have widths that are multiples of 32");
    at::Tensor r = part.reshape({-1, part.size(-1)});
    rows2d.push_back(r.stride(1) == 1 ? r : r.contiguous());
    width += part.size(-1);
  }
  TORCH_CHECK(width == in, "amx_linear: inputs have ", width, " features together, the weight ", weight.sizes(),
              " expects ", in);
  const at::Tensor w = weight.stride(1) == 1 && weight.stride(0) % 2 == 0 ? weight : weight.contiguous();
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  const int64_t rows = rows2d.front().size(0);
  std::vector<int64_t> sizes = leading.vec();
  sizes.push_back(out);
  at::Tensor y = at::empty({rows, out}, first.options());
  if (rows == 0) return y.view(sizes);

  std::vector<AmxInputPart> parts;
  for (const at::Tensor& r : rows2d) {
    AmxInputPart part;
    part.x = bits_of(r);
    part.stride = r.stride(0);
    part.width = r.size(1);
    parts.push_back(part);
  }
  AmxLinearArgs args;
  args.parts = parts.data();
  args.part_count = static_cast<int64_t>(parts.size());
  args.w = bits_of(w);
  args.w_stride = w.stride(0);
  args.bias = b.defined() ? bits_of(b) : nullptr;
  args.gelu_tanh = gelu_tanh;
  args.y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  args.y_stride = out;
  args.rows = rows;
  args.in = in;
  args.out = out;
  // Each thread takes a run of 32-column blocks: it packs only its part of the weight, and the
  // split moves no sum (amx_gemm_kernel.h).
  at::parallel_for(0, out / 32, 1, [&](int64_t begin, int64_t end) {
    static thread_local ThreadScratch scratch;
    AmxScratch buffers;
    buffers.packed_w = static_cast<uint32_t*>(scratch.packed_w.get(sizeof(uint16_t) * 32 * (end - begin) * in, "amx_linear"));
    buffers.sums = static_cast<float*>(scratch.sums.get(sizeof(float) * kAmxRowBlock * kAmxColumnBlock, "amx_linear"));
    buffers.tail_rows = static_cast<uint16_t*>(scratch.tail_rows.get(sizeof(uint16_t) * 32 * in, "amx_linear"));
    amx_bf16_linear_columns(args, 32 * begin, 32 * end, buffers);
  });
  return y.view(sizes);
}

}  // namespace

}  // namespace shardit::nn::cpu
