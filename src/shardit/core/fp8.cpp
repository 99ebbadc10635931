#include "shardit/core/fp8.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace shardit {

const char* fp8_format_name(Fp8Format format) { return format == Fp8Format::E4M3 ? "F8_E4M3" : "F8_E5M2"; }

float fp8_to_float(uint8_t code, Fp8Format format) {
  const bool negative = (code & 0x80) != 0;
  const int mantissa_bits = format == Fp8Format::E4M3 ? 3 : 2;
  const int bias = format == Fp8Format::E4M3 ? 7 : 15;
  const int exponent = (code & 0x7F) >> mantissa_bits;
  const int mantissa = code & ((1 << mantissa_bits) - 1);
  const int max_exponent = (1 << (7 - mantissa_bits)) - 1;
  float magnitude = 0.0f;
  if (format == Fp8Format::E4M3 && exponent == max_exponent && mantissa == 7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (format == Fp8Format::E5M2 && exponent == max_exponent) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), 1 - bias - mantissa_bits);  // subnormal
  } else {
    magnitude = std::ldexp(static_cast<float>((1 << mantissa_bits) + mantissa), exponent - bias - mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

uint8_t float_to_e4m3(float value) {
  if (std::isnan(value)) return 0x7F;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float magnitude = std::fabs(value);
  if (magnitude >= 448.0f) return sign | 0x7E;  // satfinite
  if (magnitude < 0.015625f) {
    // Subnormal: steps of 2^-9; scaling by a power of two is exact, so nearbyint rounds the true
    // value to nearest, ties to even. 8 steps is the smallest normal, code 0x08, as it should be.
    return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(magnitude, 9)));
  }
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude in [2^(exponent-1), 2^exponent)
  const int unbiased = exponent - 1;
  // Normal: 8 + mantissa steps of 2^(unbiased - 3); rounding up to 16 carries into the exponent.
  int steps = static_cast<int>(std::nearbyint(std::ldexp(magnitude, 3 - unbiased)));
  int biased = unbiased + 7;
  if (steps == 16) {
    steps = 8;
    ++biased;
  }
  if (biased > 15 || (biased == 15 && steps - 8 == 7)) return sign | 0x7E;  // rounds past 448
  return sign | static_cast<uint8_t>((biased << 3) | (steps - 8));
}

const at::Tensor& fp8_value_table(Fp8Format format) {
  static const auto make = [](Fp8Format f) {
    at::Tensor table = at::empty({256}, at::kFloat);
    float* out = table.data_ptr<float>();
    for (int code = 0; code < 256; ++code) out[code] = fp8_to_float(static_cast<uint8_t>(code), f);
    return table;
  };
  static const at::Tensor e4m3 = make(Fp8Format::E4M3);
  static const at::Tensor e5m2 = make(Fp8Format::E5M2);
  return format == Fp8Format::E4M3 ? e4m3 : e5m2;
}

at::Tensor fp8_decode(const at::Tensor& codes, Fp8Format format, at::ScalarType dtype) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "fp8_decode: ", fp8_format_name(format),
              " codes must be uint8 bytes, got ", codes.scalar_type());
  const at::Tensor table = fp8_value_table(format).to(codes.device());
  // [numel] gathered from the table, reshaped back.
  return table.index_select(0, codes.reshape({-1}).to(at::kLong)).view(codes.sizes()).to(dtype);
}

at::Tensor e4m3_encode(const at::Tensor& values) {
  TORCH_CHECK(at::isFloatingType(values.scalar_type()), "e4m3_encode: expected floating values, got ",
              values.scalar_type());
  const at::Tensor source = values.to(at::kCPU, at::kFloat).contiguous();
  at::Tensor codes = at::empty(source.sizes(), at::kByte);
  const float* in = source.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  at::parallel_for(0, source.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = float_to_e4m3(in[i]);
  });
  return codes.to(values.device());
}

}  // namespace shardit
