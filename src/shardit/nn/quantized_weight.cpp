#include "shardit/nn/quantized_weight.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <utility>

#include "shardit/core/fp8.h"
#include "shardit/nn/gguf_dequantize.h"

namespace shardit::nn {

namespace {

template <class T>
void dequantize_kernel(const at::Tensor& codes, const float* table, const float* scale, at::Tensor& out) {
  const int64_t rows = codes.size(0);
  const int64_t cols = codes.size(1);
  T* dst = out.data_ptr<T>();
  const bool int8 = table == nullptr;
  const auto* bytes = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* ints = static_cast<const int8_t*>(codes.data_ptr());
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, cols)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       const float s = scale[r];
                       T* row = dst + r * cols;
                       if (int8) {
                         const int8_t* src = ints + r * cols;
                         for (int64_t c = 0; c < cols; ++c) row[c] = static_cast<T>(static_cast<float>(src[c]) * s);
                       } else {
                         const uint8_t* src = bytes + r * cols;
                         for (int64_t c = 0; c < cols; ++c) row[c] = static_cast<T>(table[src[c]] * s);
                       }
                     }
                   });
}

}  // namespace

const char* weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::Dense: return "dense";
    case WeightFormat::Fp8E4M3: return "fp8-e4m3";
    case WeightFormat::Fp8E5M2: return "fp8-e5m2";
    case WeightFormat::Int8: return "int8";
    case WeightFormat::GgufQ4_0: return "gguf-q4_0";
    case WeightFormat::GgufQ4_1: return "gguf-q4_1";
    case WeightFormat::GgufQ5_0: return "gguf-q5_0";
    case WeightFormat::GgufQ5_1: return "gguf-q5_1";
    case WeightFormat::GgufQ8_0: return "gguf-q8_0";
    case WeightFormat::GgufQ4_K: return "gguf-q4_k";
    case WeightFormat::GgufQ5_K: return "gguf-q5_k";
    case WeightFormat::GgufQ6_K: return "gguf-q6_k";
    case WeightFormat::GgufQ8_K: return "gguf-q8_k";
  }
  return "?";
}

namespace {

// The GGUF block formats and their ggml types.
constexpr std::pair<WeightFormat, io::GgmlType> kGgufFormats[] = {
    {WeightFormat::GgufQ4_0, io::GgmlType::Q4_0}, {WeightFormat::GgufQ4_1, io::GgmlType::Q4_1},
    {WeightFormat::GgufQ5_0, io::GgmlType::Q5_0}, {WeightFormat::GgufQ5_1, io::GgmlType::Q5_1},
    {WeightFormat::GgufQ8_0, io::GgmlType::Q8_0}, {WeightFormat::GgufQ4_K, io::GgmlType::Q4_K},
    {WeightFormat::GgufQ5_K, io::GgmlType::Q5_K}, {WeightFormat::GgufQ6_K, io::GgmlType::Q6_K},
    {WeightFormat::GgufQ8_K, io::GgmlType::Q8_K},
};

}  // namespace

bool weight_format_is_gguf(WeightFormat format) {
  for (const auto& [f, type] : kGgufFormats) {
    if (f == format) return true;
  }
  return false;
}

io::GgmlType gguf_type_of(WeightFormat format) {
  for (const auto& [f, type] : kGgufFormats) {
    if (f == format) return type;
  }
  TORCH_INTERNAL_ASSERT(false, "gguf_type_of: ", weight_format_name(format), " is not a GGUF format");
}

WeightFormat gguf_weight_format(io::GgmlType type, const std::string& what) {
  for (const auto& [format, t] : kGgufFormats) {
    if (t == type) return format;
  }
  TORCH_CHECK(false, what, " is stored as ggml type ", io::ggml_type_name(type),
              ", which a Linear does not hold as blocks (it holds Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and "
              "Q8_K; F32, F16 and BF16 weights load dense)");
}

const char* weights_dtype_name(WeightsDtype dtype) {
  switch (dtype) {
    case WeightsDtype::Checkpoint: return "checkpoint";
    case WeightsDtype::Fp8: return "fp8";
    case WeightsDtype::Int8: return "int8";
  }
  return "?";
}

WeightsDtype parse_weights_dtype(const std::string& name) {
  if (name == "checkpoint") return WeightsDtype::Checkpoint;
  if (name == "fp8") return WeightsDtype::Fp8;
  if (name == "int8") return WeightsDtype::Int8;
  TORCH_CHECK(false, "--weights-dtype: unknown value '", name, "'; expected checkpoint, fp8 or int8");
}

int64_t weights_element_size(WeightsDtype dtype, int64_t dense_element_size) {
  return dtype == WeightsDtype::Checkpoint ? dense_element_size : 1;
}

float weight_format_max(WeightFormat format) {
  switch (format) {
    case WeightFormat::Fp8E4M3: return 448.0f;
    case WeightFormat::Fp8E5M2: return 57344.0f;
    case WeightFormat::Int8: return 127.0f;
    default: break;
  }
  TORCH_INTERNAL_ASSERT(false, "weight_format_max: a ", weight_format_name(format), " weight has no code range");
}

at::Tensor dequantize_rows(const at::Tensor& codes, WeightFormat format, const at::Tensor& scale,
                           at::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(format != WeightFormat::Dense);
  if (weight_format_is_gguf(format)) return gguf_dequantize(codes, gguf_type_of(format), dtype);
  TORCH_INTERNAL_ASSERT(codes.dim() == 2 && scale.dim() == 1 && scale.size(0) == codes.size(0),
                        "dequantize_rows: codes ", codes.sizes(), " and scale ", scale.sizes(), " do not match");
  TORCH_INTERNAL_ASSERT(codes.scalar_type() == (format == WeightFormat::Int8 ? at::kChar : at::kByte));
  if (!codes.device().is_cpu()) {
    // Off the CPU: the same fp32 product, by tensor ops (a gather from the value table).
    at::Tensor values = format == WeightFormat::Int8
                            ? codes.to(at::kFloat)
                            : fp8_decode(codes, format == WeightFormat::Fp8E4M3 ? Fp8Format::E4M3 : Fp8Format::E5M2,
                                         at::kFloat);
    return values.mul_(scale.to(codes.device(), at::kFloat).unsqueeze(1)).to(dtype);
  }
  const at::Tensor source = codes.contiguous();
  const at::Tensor scales = scale.to(at::kFloat).contiguous();
  const float* table = nullptr;
  if (format != WeightFormat::Int8) {
    table = fp8_value_table(format == WeightFormat::Fp8E4M3 ? Fp8Format::E4M3 : Fp8Format::E5M2).data_ptr<float>();
  }
  at::Tensor out = at::empty(codes.sizes(), at::TensorOptions().dtype(dtype));
  switch (dtype) {
    case at::kFloat: dequantize_kernel<float>(source, table, scales.data_ptr<float>(), out); break;
    case at::kBFloat16: dequantize_kernel<at::BFloat16>(source, table, scales.data_ptr<float>(), out); break;
    case at::kHalf: dequantize_kernel<at::Half>(source, table, scales.data_ptr<float>(), out); break;
    case at::kDouble: dequantize_kernel<double>(source, table, scales.data_ptr<float>(), out); break;
    default: TORCH_CHECK(false, "dequantize_rows: unsupported compute dtype ", dtype);
  }
  return out;
}

at::Tensor symmetric_row_scales(const at::Tensor& row_absmax, WeightFormat format) {
  return symmetric_row_scales(row_absmax, weight_format_max(format));
}

at::Tensor symmetric_row_scales(const at::Tensor& row_absmax, float code_max) {
  at::Tensor scale = row_absmax.to(at::kFloat) / code_max;
  return at::where(scale > 0, scale, at::ones_like(scale));
}

at::Tensor quantize_rows(const at::Tensor& weight, WeightFormat format, const at::Tensor& scale) {
  TORCH_INTERNAL_ASSERT(weight.dim() == 2 && scale.dim() == 1 && scale.size(0) == weight.size(0));
  // Divided in fp32: the same row, scale and code on every rank.
  const at::Tensor scaled = weight.to(at::kFloat) / scale.to(weight.device(), at::kFloat).unsqueeze(1);
  switch (format) {
    case WeightFormat::Fp8E4M3: return e4m3_encode(scaled);
    case WeightFormat::Int8: return scaled.round().clamp(-127, 127).to(at::kChar);  // round: half to even
    default: TORCH_CHECK(false, "quantize_rows: cannot quantize to ", weight_format_name(format));
  }
}

}  // namespace shardit::nn
