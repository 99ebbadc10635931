#pragma once
// The two 8-bit float formats of safetensors (F8_E4M3, F8_E5M2; OCP FP8 as torch's float8_e4m3fn
// and float8_e5m2), held as their raw bytes in uint8 tensors: LibTorch before 2.1 has no float8
// scalar type, and these are exact bit-level conversions that need none.
//   e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN;
//           largest finite 448, smallest subnormal 2^-9.
//   e5m2:   1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like (infinities and NaNs).
#include <ATen/ATen.h>

#include <cstdint>

namespace shardit {

enum class Fp8Format { E4M3, E5M2 };
/// "F8_E4M3", "F8_E5M2" (the safetensors names).
const char* fp8_format_name(Fp8Format format);

/// The exact value of one code.
float fp8_to_float(uint8_t code, Fp8Format format);
/// The e4m3fn code nearest to `value`, ties to the even code; magnitudes past 448 saturate to
/// ±448 (OCP "satfinite", what quantizers want: a scale already maps the row's max to 448) and
/// NaN gives the NaN code 0x7F.
uint8_t float_to_e4m3(float value);

/// The 256 exact values of `format`, indexed by code ([256] float32).
const at::Tensor& fp8_value_table(Fp8Format format);
/// `codes` (uint8 bytes of `format`) as exact values in `dtype` (rounded once when `dtype` is
/// narrower than the format, e.g. never for float32).
at::Tensor fp8_decode(const at::Tensor& codes, Fp8Format format, at::ScalarType dtype);
/// `values` (any floating dtype) rounded to e4m3fn codes (uint8) by float_to_e4m3.
at::Tensor e4m3_encode(const at::Tensor& values);

}  // namespace shardit
