// 8-bit weights: the FP8 codecs against the references of support/quantization_case (written
// from the OCP FP8 definitions: powers in double, nearest value by search), and the per-row quantizer and
// quantized Linear against the dense computation they stand for.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "shardit/core/fp8.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/quantized_weight.h"
#include "support/quantization_case.h"

namespace test_quantization {
namespace {

using shardit::Fp8Format;

using shardit::testing::reference_fp8_value;

void expect_all_codes(Fp8Format format, int exponent_bits, int mantissa_bits, bool fn) {
  at::Tensor codes = at::arange(256, at::kInt).to(at::kByte);
  const at::Tensor decoded = shardit::fp8_decode(codes, format, at::kFloat);
  for (int code = 0; code < 256; ++code) {
    const double expected = reference_fp8_value(code, exponent_bits, mantissa_bits, fn);
    const float got = shardit::fp8_to_float(static_cast<uint8_t>(code), format);
    const float tensor_got = decoded[code].item<float>();
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got) && std::isnan(tensor_got)) << "code " << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), expected) << "code " << code;
      EXPECT_EQ(static_cast<double>(tensor_got), expected) << "code " << code;
      EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << "code " << code;
    }
  }
}

TEST(Fp8, E4m3DecodesEveryCodeExactly) {
  expect_all_codes(Fp8Format::E4M3, 4, 3, /*fn=*/true);
  // Landmarks of the format.
  EXPECT_EQ(shardit::fp8_to_float(0x7E, Fp8Format::E4M3), 448.0f);
  EXPECT_EQ(shardit::fp8_to_float(0x01, Fp8Format::E4M3), std::ldexp(1.0f, -9));
  EXPECT_EQ(shardit::fp8_to_float(0x08, Fp8Format::E4M3), std::ldexp(1.0f, -6));
  EXPECT_EQ(shardit::fp8_to_float(0x38, Fp8Format::E4M3), 1.0f);
  EXPECT_EQ(shardit::fp8_to_float(0xB8, Fp8Format::E4M3), -1.0f);
}

TEST(Fp8, E5m2DecodesEveryCodeExactly) {
  expect_all_codes(Fp8Format::E5M2, 5, 2, /*fn=*/false);
  EXPECT_EQ(shardit::fp8_to_float(0x7B, Fp8Format::E5M2), 57344.0f);
  EXPECT_EQ(shardit::fp8_to_float(0x3C, Fp8Format::E5M2), 1.0f);
  EXPECT_TRUE(std::isinf(shardit::fp8_to_float(0x7C, Fp8Format::E5M2)));
}

TEST(Fp8, E4m3EncodeRoundsToNearestEven) {
  std::vector<float> values = {0.0f, -0.0f, 448.0f, 449.0f, 464.0f, 1e9f, -1e9f, 1e-12f, -1e-12f,
                               std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  // Every finite value, every midpoint between neighbours (the ties) and a float either side.
  for (int code = 0; code < 0x7E; ++code) {
    const double low = reference_fp8_value(code, 4, 3, true), high = reference_fp8_value(code + 1, 4, 3, true);
    const auto mid = static_cast<float>((low + high) / 2);
    for (const float v : {static_cast<float>(low), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
      values.push_back(v);
      values.push_back(-v);
    }
  }
  // Log-uniform values over the whole range, below the smallest subnormal to past the largest.
  at::manual_seed(0);
  const at::Tensor random = at::exp2(at::rand({4000}) * 22 - 12) * (at::randint(0, 2, {4000}) * 2 - 1);
  for (int64_t i = 0; i < random.numel(); ++i) values.push_back(random[i].item<float>());

  const at::Tensor tensor = at::tensor(values);
  const at::Tensor encoded = shardit::e4m3_encode(tensor);
  for (size_t i = 0; i < values.size(); ++i) {
    const int expected = shardit::testing::reference_e4m3_code(values[i]);
    ASSERT_EQ(static_cast<int>(shardit::float_to_e4m3(values[i])), expected) << "value " << values[i];
    ASSERT_EQ(encoded[static_cast<int64_t>(i)].item<uint8_t>(), expected) << "value " << values[i];
  }
  EXPECT_EQ(shardit::float_to_e4m3(std::nanf("")), 0x7F);
}

TEST(QuantizedWeight, Int8RowsUseTheWholeRowsMaximum) {
  const at::Tensor weight = at::tensor({1.0f, -2.0f, 0.5f, 254.0f, 0.0f, 0.0f, 0.0f, 0.0f}).view({2, 4});
  const at::Tensor absmax = weight.abs().amax(1);
  const at::Tensor scale = shardit::nn::symmetric_row_scales(absmax, shardit::nn::WeightFormat::Int8);
  EXPECT_EQ(scale[0].item<float>(), 2.0f);  // 254 / 127
  EXPECT_EQ(scale[1].item<float>(), 1.0f);  // an all-zero row
  const at::Tensor codes = shardit::nn::quantize_rows(weight, shardit::nn::WeightFormat::Int8, scale);
  ASSERT_EQ(codes.scalar_type(), at::kChar);
  // 0.5 / 2 = 0.25 -> 0; 1 / 2 = 0.5 -> 0 (half to even); -2 / 2 = -1; 254 / 2 = 127.
  EXPECT_TRUE(at::equal(codes, at::tensor({0, -1, 0, 127, 0, 0, 0, 0}, at::kChar).view({2, 4})));
  const at::Tensor dense = shardit::nn::dequantize_rows(codes, shardit::nn::WeightFormat::Int8, scale, at::kFloat);
  EXPECT_TRUE(at::equal(dense, at::tensor({0.0f, -2.0f, 0.0f, 254.0f, 0.0f, 0.0f, 0.0f, 0.0f}).view({2, 4})));
}

TEST(QuantizedWeight, DequantizedRowsRoundOnceToTheComputeDtype) {
  at::manual_seed(1);
  const at::Tensor weight = at::randn({37, 53});
  const at::Tensor scale = shardit::nn::symmetric_row_scales(weight.abs().amax(1), shardit::nn::WeightFormat::Fp8E4M3);
  const at::Tensor codes = shardit::nn::quantize_rows(weight, shardit::nn::WeightFormat::Fp8E4M3, scale);
  const at::Tensor exact = shardit::fp8_decode(codes, Fp8Format::E4M3, at::kFloat) * scale.unsqueeze(1);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor dense = shardit::nn::dequantize_rows(codes, shardit::nn::WeightFormat::Fp8E4M3, scale, dtype);
    EXPECT_TRUE(at::equal(dense, exact.to(dtype))) << dtype;
  }
  // The row maximum maps to 448 exactly, so it comes back (up to the fp32 product) unchanged.
  EXPECT_TRUE(at::allclose(exact.abs().amax(1), weight.abs().amax(1), 1e-6, 0));
}

TEST(QuantizedWeight, LinearForwardUsesTheDequantizedWeight) {
  at::manual_seed(2);
  shardit::nn::Linear dense(shardit::nn::LinearOptions(24, 16));
  shardit::nn::Linear quantized(shardit::nn::LinearOptions(24, 16));
  const at::Tensor weight = at::randn({16, 24});
  const at::Tensor bias = at::randn({16});
  const at::Tensor scale = shardit::nn::symmetric_row_scales(weight.abs().amax(1), shardit::nn::WeightFormat::Int8);
  const at::Tensor codes = shardit::nn::quantize_rows(weight, shardit::nn::WeightFormat::Int8, scale);
  dense.weight = shardit::nn::dequantize_rows(codes, shardit::nn::WeightFormat::Int8, scale, at::kFloat);
  dense.bias = bias;
  quantized.weight = weight;
  quantized.bias = bias;
  quantized.set_quantized_weight(codes, shardit::nn::WeightFormat::Int8, scale, at::kFloat);
  EXPECT_EQ(quantized.weight.scalar_type(), at::kChar);  // held in 8 bits
  EXPECT_EQ(quantized.weight_dtype(), at::kFloat);
  const at::Tensor x = at::randn({3, 5, 24});
  EXPECT_TRUE(at::equal(quantized.forward(x), dense.forward(x)));
  EXPECT_TRUE(at::equal(quantized.forward_blocks({x.narrow(-1, 0, 8), x.narrow(-1, 8, 16)}), dense.forward(x)));
}

}  // namespace
}  // namespace test_quantization
