// Malformed 8-bit checkpoints fail while loading, before any weight is read or any forward runs,
// with an error naming the file, the tensor and the problem: a missing, mis-shaped, zero or NaN
// scale, NaN FP8 codes, a scale beside a dense weight, NaN in a weight to be quantized, and int8
// compute asked for without int8 weights.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/models/registry.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/quantization_case.h"
#include "support/test_support.h"

namespace test_quantization_errors {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using shardit::testing::error_of;

using Tensors = std::map<std::string, at::Tensor>;

/// The built-in model's transformer, with its Linear weights stored F8_E4M3 (per-row scales when
/// `scales`), then `edit` applied to the tensors (raw bytes for the F8 ones) before it is written.
std::string edited_checkpoint(shardit::testing::Fp8Scales scales, const std::function<void(Tensors&)>& edit) {
  const auto builtin = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  const std::string dir = shardit::testing::make_temp_dir("fp8-errors") + "/transformer";
  shardit::testing::write_fp8_checkpoint(builtin.transformer, dir, scales);
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  auto opened = shardit::io::SafetensorsFile::open(file);
  Tensors tensors;
  std::map<std::string, shardit::io::StDtype> stored_as;
  for (const std::string& name : opened->names()) {
    tensors[name] = opened->read(name);
    if (shardit::io::st_dtype_is_fp8(opened->info(name).dtype)) stored_as[name] = opened->info(name).dtype;
  }
  opened.reset();
  edit(tensors);
  // A tensor the edit replaced by a dense one is written as what it now is.
  for (auto it = stored_as.begin(); it != stored_as.end();) {
    it = tensors.count(it->first) != 0 && tensors[it->first].scalar_type() != at::kByte ? stored_as.erase(it) : std::next(it);
  }
  std::vector<std::pair<std::string, at::Tensor>> ordered(tensors.begin(), tensors.end());
  shardit::io::save_safetensors(file, ordered, {}, stored_as);
  return dir;
}

/// The error of loading `dir` with `weights`; the model must hold no weight afterwards.
std::string load_error(const std::string& dir, shardit::nn::WeightsDtype weights = shardit::nn::WeightsDtype::Checkpoint) {
  const auto folder = shardit::io::open_component(dir, "transformer");
  auto model = shardit::models::create_transformer(folder);
  shardit::parallel::LoadOptions options;
  options.weights = weights;
  const std::string message = error_of([&] { model->load(folder.weights(), options); });
  EXPECT_FALSE(model->is_materialized());
  return message;
}

constexpr const char* kLayer = "transformer_blocks.0.attn.to_q";

TEST(QuantizedLoad, RefusesAMissingScale) {
  const std::string dir = edited_checkpoint(shardit::testing::Fp8Scales::PerRow,
                                            [](Tensors& t) { t.erase(std::string(kLayer) + ".weight_scale"); });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr("have no scale"), HasSubstr(std::string(kLayer) + ".weight"),
                                     HasSubstr("weight_scale")));
}

TEST(QuantizedLoad, RefusesAScaleOfTheWrongShape) {
  const std::string dir = edited_checkpoint(shardit::testing::Fp8Scales::PerRow, [](Tensors& t) {
    at::Tensor& scale = t[std::string(kLayer) + ".weight_scale"];
    scale = at::cat({scale, scale}).view({2, -1});
  });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(std::string(kLayer) + ".weight_scale' has shape [2, "),
                                     HasSubstr("block-wise scales are not supported")));
}

TEST(QuantizedLoad, RefusesAZeroScale) {
  const std::string dir = edited_checkpoint(shardit::testing::Fp8Scales::PerRow, [](Tensors& t) {
    t[std::string(kLayer) + ".weight_scale"][3] = 0.0f;
  });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(std::string(kLayer) + ".weight_scale"), HasSubstr("at index 3"),
                                     HasSubstr("must be positive")));
}

TEST(QuantizedLoad, RefusesANanScale) {
  const std::string dir = edited_checkpoint(shardit::testing::Fp8Scales::PerTensor, [](Tensors& t) {
    t[std::string(kLayer) + ".weight_scale"].fill_(std::numeric_limits<float>::quiet_NaN());
  });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(std::string(kLayer) + ".weight_scale"), HasSubstr("must be finite")));
}

TEST(QuantizedLoad, RefusesNanFp8Codes) {
  const std::string dir = edited_checkpoint(shardit::testing::Fp8Scales::None, [](Tensors& t) {
    // The code itself (LibTorch 2.x reads FP8 as its float8 type, 1.x as bytes): e4m3fn's NaN.
    t[std::string(kLayer) + ".weight"].view(at::kByte)[0][0] = 0x7F;
  });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(std::string(kLayer) + ".weight"), HasSubstr("NaN or Inf codes")));
}

TEST(QuantizedLoad, RefusesAScaleBesideADenseWeight) {
  const std::string dir = edited_checkpoint(shardit::testing::Fp8Scales::PerRow, [](Tensors& t) {
    // The FP8 weight replaced by a dense one, its scale left behind.
    t[std::string(kLayer) + ".weight"] = at::randn(t[std::string(kLayer) + ".weight"].sizes());
  });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(std::string(kLayer) + ".weight_scale"), HasSubstr("not an 8-bit weight")));
}

TEST(QuantizedLoad, RefusesToQuantizeNan) {
  const auto builtin = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  const std::string dir = shardit::testing::make_temp_dir("int8-nan") + "/transformer";
  shardit::testing::write_fp8_checkpoint(builtin.transformer, dir, shardit::testing::Fp8Scales::None);
  // Rewritten dense (F32), with one NaN.
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  const auto source = shardit::io::open_component(builtin.transformer, "transformer").weights();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const std::string& name : source.names()) tensors.emplace_back(name, source.read(name, at::kFloat));
  for (auto& [name, value] : tensors) {
    if (name == std::string(kLayer) + ".weight") value[1][2] = std::numeric_limits<float>::quiet_NaN();
  }
  shardit::io::save_safetensors(file, tensors);
  EXPECT_THAT(load_error(dir, shardit::nn::WeightsDtype::Int8),
              AllOf(HasSubstr(std::string(kLayer) + ".weight"), HasSubstr("refusing to quantize")));
}

TEST(QuantizedLoad, RefusesInt8ComputeWithoutInt8Weights) {
  // Before anything is read: the model holds no weight afterwards.
  const auto builtin = shardit::models::write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  const auto folder = shardit::io::open_component(builtin.transformer, "transformer");
  for (const auto weights : {shardit::nn::WeightsDtype::Checkpoint, shardit::nn::WeightsDtype::Fp8}) {
    auto model = shardit::models::create_transformer(folder);
    shardit::parallel::LoadOptions options;
    options.weights = weights;
    options.int8_compute = true;
    EXPECT_THAT(error_of([&] { model->load(folder.weights(), options); }),
                HasSubstr("--int8-compute multiplies int8 weights: add --weights-dtype int8"));
    EXPECT_FALSE(model->is_materialized());
  }
}

}  // namespace
}  // namespace test_quantization_errors
