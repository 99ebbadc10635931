#pragma once
// 8-bit weights kept in 8 bits: a Linear holds codes (the raw bytes of FP8 values, or int8
// integers) and one fp32 scale per output row, and dequantizes the rows it holds to the compute
// dtype at each forward (w[o, i] = value(code[o, i]) * scale[o]). Scales are per output row
// because that is the one granularity every tensor-parallel split keeps whole or splits along
// with the rows: colwise layers take their rows' scales, rowwise layers hold every row (part of
// each) and so every scale. See docs/quantization.md.
#include <ATen/ATen.h>

#include <string>

#include "shardit/io/gguf.h"

namespace shardit::nn {

/// How a Linear's weight is stored.
enum class WeightFormat {
  Dense,    ///< the compute dtype (or fp32 for keep-in-fp32 modules)
  Fp8E4M3,  ///< uint8 bytes of e4m3fn values
  Fp8E5M2,  ///< uint8 bytes of e5m2 values
  Int8,     ///< int8 integers in [-127, 127] (symmetric)
  /// GGUF (ggml) blocks as a GGUF file stores them: uint8 codes [out, row_bytes], each row whole
  /// blocks that carry their own scales (no per-row scale); dequantized by nn/gguf_dequantize.h.
  GgufQ4_0, GgufQ4_1, GgufQ5_0, GgufQ5_1, GgufQ8_0, GgufQ4_K, GgufQ5_K, GgufQ6_K, GgufQ8_K,
};
/// "dense", "fp8-e4m3", "fp8-e5m2", "int8", "gguf-q4_k", ...
const char* weight_format_name(WeightFormat format);

/// True for the GGUF block formats.
bool weight_format_is_gguf(WeightFormat format);
/// The ggml type of a GGUF block format (an internal error for the others).
io::GgmlType gguf_type_of(WeightFormat format);
/// The format a Linear holds `type`'s blocks in; refuses (naming `what`) the types it does not hold
/// as blocks: F32, F16 and BF16 load dense, and types gguf_dequantize does not handle.
WeightFormat gguf_weight_format(io::GgmlType type, const std::string& what);

/// Which low-precision storage quantize-on-load produces (`--weights-dtype`).
enum class WeightsDtype { Checkpoint, Fp8, Int8 };
/// "checkpoint" (keep the checkpoint's storage: FP8 tensors stay FP8, others load dense), "fp8", "int8".
const char* weights_dtype_name(WeightsDtype dtype);
/// The value named `name` ("checkpoint", "fp8", "int8"); an error listing the names otherwise.
WeightsDtype parse_weights_dtype(const std::string& name);
/// Bytes per weight element a Linear holds in `dtype`; `dense_element_size` for Checkpoint.
int64_t weights_element_size(WeightsDtype dtype, int64_t dense_element_size);

/// The largest magnitude a code of `format` stands for (448 for e4m3, 57344 for e5m2, 127 for int8).
float weight_format_max(WeightFormat format);

/// [out, in] `codes` of `format` times the per-row `scale` ([out] fp32), in `dtype`. Each element
/// is computed in fp32 and rounded once, so equal codes and scales give bit-equal weights
/// whichever rank holds them. GGUF formats: `codes` are [out, row_bytes] blocks and `scale` is
/// unused (undefined); the values are gguf_dequantize's.
at::Tensor dequantize_rows(const at::Tensor& codes, WeightFormat format, const at::Tensor& scale, at::ScalarType dtype);

/// Symmetric per-row scales for `row_absmax` ([out], the largest |w| of each whole row): absmax /
/// the format's max, 1 for an all-zero row (its codes are all zero whatever the scale).
at::Tensor symmetric_row_scales(const at::Tensor& row_absmax, WeightFormat format);
/// The same for a code range of ±`code_max` (int8 compute's activation codes).
at::Tensor symmetric_row_scales(const at::Tensor& row_absmax, float code_max);
/// [out, in] float `weight` quantized to `format` (Fp8E4M3 or Int8) with per-row `scale` ([out]):
/// e4m3 codes of w / scale rounded to nearest even, or round-half-even(w / scale) clamped to ±127.
at::Tensor quantize_rows(const at::Tensor& weight, WeightFormat format, const at::Tensor& scale);

}  // namespace shardit::nn
