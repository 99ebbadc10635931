// Int8 compute (nn/int8_compute.h): a Linear with an int8 weight multiplying per-token int8
// activation codes in LibTorch's quantized engine. Against the integer product it stands for (bit
// for bit: the engine's accumulator is exact and the scales are applied in the documented order),
// against the dense Linear on the dequantized weight (within the activation-rounding bound), and
// per token (a row's result does not depend on the other rows); the CLI's flag.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

#include "shardit/models/builtin.h"
#include "shardit/nn/int8_compute.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/quantized_weight.h"
#include "support/test_support.h"

namespace test_int8_compute {
namespace {

using ::testing::HasSubstr;
using shardit::nn::Linear;
using shardit::nn::LinearOptions;
using shardit::nn::WeightFormat;

struct Int8Layers {
  std::shared_ptr<Linear> int8;   ///< int8 weight, int8 compute
  std::shared_ptr<Linear> dense;  ///< the dequantized weight, dense product
  at::Tensor codes;               ///< [out, in] int8
  at::Tensor scale;               ///< [out] fp32
};

Int8Layers int8_layers(int64_t in, int64_t out, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor weight = at::randn({out, in});
  const at::Tensor bias = at::randn({out});
  Int8Layers layers;
  layers.scale = shardit::nn::symmetric_row_scales(weight.abs().amax(1), WeightFormat::Int8);
  layers.codes = shardit::nn::quantize_rows(weight, WeightFormat::Int8, layers.scale);
  layers.dense = std::make_shared<Linear>(LinearOptions(in, out));
  layers.dense->weight = shardit::nn::dequantize_rows(layers.codes, WeightFormat::Int8, layers.scale, at::kFloat);
  layers.dense->bias = bias;
  layers.int8 = std::make_shared<Linear>(LinearOptions(in, out));
  layers.int8->bias = bias;
  layers.int8->set_quantized_weight(layers.codes, WeightFormat::Int8, layers.scale, at::kFloat);
  layers.int8->enable_int8_compute();
  return layers;
}

/// The formula of nn/int8_compute.h computed with LibTorch's tensor ops: per-token codes, their
/// integer product with the weight's codes (in double: exact), then the scales in fp32 in the
/// documented order, then the bias.
at::Tensor reference_product(const at::Tensor& x, const Int8Layers& layers) {
  const at::Tensor tokens = x.reshape({-1, x.size(-1)}).to(at::kFloat);
  const double code_max = shardit::nn::int8_activation_code_max();
  at::Tensor x_scale = tokens.abs().amax(1) / static_cast<float>(code_max);
  x_scale = at::where(x_scale > 0, x_scale, at::ones_like(x_scale));
  const at::Tensor x_codes = (tokens / x_scale.unsqueeze(1)).round().clamp(-code_max, code_max);
  const at::Tensor accumulator = at::matmul(x_codes.to(at::kDouble), layers.codes.to(at::kDouble).t()).to(at::kFloat);
  at::Tensor y = accumulator * layers.scale * x_scale.unsqueeze(1) + layers.int8->bias;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);
}

TEST(Int8Compute, UsesAnX86QuantizedEngine) {
  // The engine is LibTorch's; which one it is belongs in the bench reports.
  const at::QEngine engine = shardit::nn::int8_compute_engine();
  EXPECT_TRUE(engine == at::QEngine::ONEDNN || engine == at::QEngine::X86 || engine == at::QEngine::FBGEMM)
      << c10::toString(engine);
  const int code_max = shardit::nn::int8_activation_code_max();
  EXPECT_TRUE(code_max == 127 || code_max == 63) << code_max;
}

TEST(Int8Compute, LinearEqualsTheIntegerProductBitForBit) {
  // Below 2^24 the accumulator is an exact fp32 integer (here |acc| <= 96 * 127 * 127 < 2^21), so
  // any difference would be a code or scale the engine changed.
  const Int8Layers layers = int8_layers(96, 40, 1);
  const at::Tensor x = at::randn({2, 7, 96}) * 3;
  const at::Tensor y = layers.int8->forward(x);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 7, 40}));
  EXPECT_TRUE(shardit::testing::tensors_close("int8 compute vs integer product", y, reference_product(x, layers), 0, 0));
}

TEST(Int8Compute, LinearStaysWithinTheActivationRoundingOfTheDenseLinear) {
  // Each activation moves by at most half its token's step x_scale[t] (the weight is the same
  // dequantized one on both sides), so |y - y_dense|[t, o] <= x_scale[t] / 2 * sum_i |w[o, i]|,
  // plus fp32 rounding of both products (1e-5 of the output's scale).
  const Int8Layers layers = int8_layers(256, 64, 2);
  at::Tensor x = at::randn({33, 256});
  x[3] *= 100;  // tokens of very different magnitudes: each keeps its own step
  x[5].zero_();
  const at::Tensor y = layers.int8->forward(x);
  const at::Tensor dense = layers.dense->forward(x);
  const at::Tensor step = x.abs().amax(1, true) / shardit::nn::int8_activation_code_max();  // [T, 1]
  const at::Tensor bound = step / 2 * layers.dense->weight.abs().sum(1).unsqueeze(0) +
                           1e-5 * dense.abs().max().item<double>();
  EXPECT_TRUE(((y - dense).abs() <= bound).all().item<bool>())
      << "max excess " << ((y - dense).abs() - bound).max().item<double>();
  // An all-zero token gives the bias exactly.
  EXPECT_TRUE(at::equal(y[5], layers.int8->bias));
  // The per-token error is a small fraction of the output (about 1/A of the input's scale).
  const double relative = ((y - dense).abs().max() / dense.abs().max()).item<double>();
  std::cout << "max |int8 compute - dense| / max |dense| = " << relative << "\n";
  EXPECT_LT(relative, 0.02);
}

TEST(Int8Compute, EachTokenIsQuantizedOnItsOwn) {
  // A token's result does not depend on the tokens computed with it (a per-tensor activation
  // scale would make row 0 depend on row 1's magnitude).
  const Int8Layers layers = int8_layers(64, 32, 3);
  at::Tensor x = at::randn({4, 64});
  x[1] *= 1000;
  const at::Tensor together = layers.int8->forward(x);
  for (int64_t t = 0; t < x.size(0); ++t) {
    EXPECT_TRUE(at::equal(together[t], layers.int8->forward(x.narrow(0, t, 1))[0])) << "token " << t;
  }
}

TEST(Int8Compute, IsDeterministicAndTakesBf16AndBlocks) {
  const Int8Layers layers = int8_layers(48, 24, 4);
  const at::Tensor x = at::randn({5, 48});
  EXPECT_TRUE(at::equal(layers.int8->forward(x), layers.int8->forward(x)));
  // A fused input runs as its concatenation.
  EXPECT_TRUE(at::equal(layers.int8->forward_blocks({x.narrow(1, 0, 16), x.narrow(1, 16, 32)}), layers.int8->forward(x)));
  // bf16 activations: the same codes where bf16 holds the values, the result in bf16.
  const at::Tensor x_bf16 = x.to(at::kBFloat16);
  const at::Tensor y_bf16 = layers.int8->forward(x_bf16);
  EXPECT_EQ(y_bf16.scalar_type(), at::kBFloat16);
  const at::Tensor expected = reference_product(x_bf16.to(at::kFloat), layers);
  EXPECT_TRUE(shardit::testing::tensors_close("bf16 int8 compute", y_bf16.to(at::kFloat), expected, 1e-2, 1e-2));
}

TEST(Int8Compute, KeepsItsCodesOnceAndRepacksANewShard) {
  Int8Layers layers = int8_layers(32, 16, 5);
  // The layer holds the engine's codes, not a copy of its own: the same values.
  EXPECT_EQ(layers.int8->weight.scalar_type(), at::kChar);
  EXPECT_TRUE(at::equal(layers.int8->weight, layers.codes));
  EXPECT_TRUE(at::equal(layers.int8->dense_weight(at::kFloat), layers.dense->weight));
  // A new weight (as the in-memory sharder sets a shard) is packed again.
  layers.int8->set_quantized_weight(layers.codes.narrow(0, 0, 8), WeightFormat::Int8, layers.scale.narrow(0, 0, 8),
                                    at::kFloat);
  EXPECT_TRUE(layers.int8->int8_compute());
  layers.int8->bias = layers.int8->bias.narrow(0, 0, 8);
  layers.dense->weight = layers.dense->weight.narrow(0, 0, 8);
  layers.dense->bias = layers.int8->bias;
  const at::Tensor x = at::randn({3, 32});
  EXPECT_EQ(layers.int8->forward(x).size(1), 8);
}

TEST(Int8Compute, RefusesWeightsThatAreNotInt8) {
  Linear dense(LinearOptions(8, 4));
  dense.weight = at::randn({4, 8});
  EXPECT_THAT(shardit::testing::error_of([&] { dense.enable_int8_compute(); }),
              HasSubstr("int8 compute needs an int8 weight, this one is dense"));
  Linear fp8(LinearOptions(8, 4));
  const at::Tensor scale = at::ones({4});
  fp8.set_quantized_weight(shardit::nn::quantize_rows(at::randn({4, 8}), WeightFormat::Fp8E4M3, scale),
                           WeightFormat::Fp8E4M3, scale, at::kFloat);
  EXPECT_THAT(shardit::testing::error_of([&] { fp8.enable_int8_compute(); }), HasSubstr("this one is fp8-e4m3"));
}

TEST(Int8Compute, RefusesOtherWeightsDtypesAndDevices) {
  using shardit::nn::WeightsDtype;
  for (const WeightsDtype weights : {WeightsDtype::Checkpoint, WeightsDtype::Fp8}) {
    EXPECT_THAT(shardit::testing::error_of([&] { shardit::nn::check_int8_compute(weights, at::kCPU); }),
                HasSubstr("add --weights-dtype int8 (got --weights-dtype " +
                          std::string(shardit::nn::weights_dtype_name(weights)) + ")"));
  }
  EXPECT_THAT(shardit::testing::error_of(
                  [&] { shardit::nn::check_int8_compute(WeightsDtype::Int8, at::Device(at::kCUDA, 0)); }),
              HasSubstr("--int8-compute runs on the CPU only"));
  shardit::nn::check_int8_compute(WeightsDtype::Int8, at::kCPU);  // accepted
}

TEST(Int8Compute, CliRunsItWithInt8WeightsAndRefusesItWithoutThem) {
  const auto builtin = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  const std::string out = shardit::testing::make_temp_dir("int8-compute-cli");
  const std::string generate = shardit::testing::cli_path() + " generate --model " + builtin.pipeline +
                               " --prompt-embeds " + builtin.prompt_embeds + " --height 32 --width 48 --steps 2";
  std::string output;
  EXPECT_EQ(shardit::testing::run_command(generate + " --weights-dtype int8 --int8-compute --out " + out + "/a.png",
                                          &output),
            0)
      << output;
  EXPECT_TRUE(std::filesystem::exists(out + "/a.png"));
  EXPECT_NE(shardit::testing::run_command(generate + " --int8-compute --out " + out + "/b.png", &output), 0);
  EXPECT_THAT(output, HasSubstr("--int8-compute multiplies int8 weights: add --weights-dtype int8"));
  EXPECT_FALSE(std::filesystem::exists(out + "/b.png"));
}

}  // namespace
}  // namespace test_int8_compute
