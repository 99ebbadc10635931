#pragma once
// Test-side references for 8-bit weights, written from the definitions independently of
// nn/quantized_weight and core/fp8 (search instead of bit arithmetic), and the checkpoints the
// quantization tests load: an FP8 copy of a checkpoint, and random-weight models wide enough for
// TP=3.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace shardit::testing {

/// The value of an FP8 code by the OCP definition: `exponent_bits` and `mantissa_bits` of
/// e4m3fn (4, 3; `fn`: no infinities, S.1111.111 is NaN) or e5m2 (5, 2).
double reference_fp8_value(int code, int exponent_bits, int mantissa_bits, bool fn);
/// The e4m3fn code nearest to `value` by binary search over the finite values, ties to the even
/// code, saturating at ±448; NaN gives 0x7F.
uint8_t reference_e4m3_code(float value);
/// reference_e4m3_code of every element (uint8, same shape).
at::Tensor reference_e4m3_codes(const at::Tensor& values);
/// Exact values of e4m3fn codes (fp32).
at::Tensor reference_e4m3_values(const at::Tensor& codes);
/// Symmetric per-row int8 of [out, in] `weight`, dequantized in fp32: s = max|row| / 127 (1 for a
/// zero row), round-half-even(w / s) clamped to ±127, times s.
at::Tensor reference_int8_dequantized(const at::Tensor& weight);

/// How write_fp8_checkpoint scales.
enum class Fp8Scales { None, PerRow, PerTensor };

/// Writes `dst_dir` (config.json and diffusion_pytorch_model.safetensors) as a copy of the
/// transformer component `src_dir` with every Linear weight of the model stored F8_E4M3 by
/// reference_e4m3_codes: unscaled (the weight's own values rounded), or with `<module>.weight_scale`
/// of max|row| / 448 ([out]) or max|w| / 448 ([]).
void write_fp8_checkpoint(const std::string& src_dir, const std::string& dst_dir, Fp8Scales scales);

/// Writes to `dst_dir` a transformer with the config of `src_dir` but `heads` attention heads (of
/// the same head dim) and seeded random weights; in every weight split along its input columns at
/// TP=2 (rowwise, packed rowwise), row 0's largest value is put in the last column, which the last
/// rank holds: the per-row scale of the other ranks must come from it.
void write_random_transformer(const std::string& src_dir, const std::string& dst_dir, int64_t heads, uint64_t seed);

}  // namespace shardit::testing
