#include "support/quantization_case.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/nn/linear.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::testing {

namespace {

const std::vector<double>& e4m3_magnitudes() {
  static const std::vector<double> values = [] {
    std::vector<double> out;
    for (int code = 0; code <= 0x7E; ++code) out.push_back(reference_fp8_value(code, 4, 3, true));
    return out;
  }();
  return values;
}

std::vector<std::string> linear_weight_names(parallel::TensorParallelModule& model) {
  std::vector<std::string> names;
  for (const auto& [path, module] : model.named_modules()) {
    if (dynamic_cast<nn::Linear*>(module) != nullptr) names.push_back(path + ".weight");
  }
  return names;
}

void write_config(const std::string& dst_dir, const nlohmann::json& config) {
  std::filesystem::create_directories(dst_dir);
  std::ofstream(dst_dir + "/config.json") << config.dump(2);
}

}  // namespace

double reference_fp8_value(int code, int exponent_bits, int mantissa_bits, bool fn) {
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int mantissa = code & ((1 << mantissa_bits) - 1);
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const int all_ones = (1 << exponent_bits) - 1;
  if (fn && exponent == all_ones && mantissa == (1 << mantissa_bits) - 1) return std::nan("");
  if (!fn && exponent == all_ones) return mantissa == 0 ? sign * HUGE_VAL : std::nan("");
  if (exponent == 0) return sign * std::pow(2.0, 1 - bias) * (mantissa / std::pow(2.0, mantissa_bits));
  return sign * std::pow(2.0, exponent - bias) * (1.0 + mantissa / std::pow(2.0, mantissa_bits));
}

uint8_t reference_e4m3_code(float value) {
  if (std::isnan(value)) return 0x7F;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0;
  const double magnitude = std::fabs(static_cast<double>(value));
  if (magnitude >= 448.0) return sign | 0x7E;
  const auto& values = e4m3_magnitudes();
  // The first value above, and the one below it.
  const auto above = std::upper_bound(values.begin(), values.end(), magnitude);
  const int high = static_cast<int>(above - values.begin());
  const int low = high - 1;
  if (values[low] == magnitude) return sign | static_cast<uint8_t>(low);
  const double to_low = magnitude - values[low], to_high = values[high] - magnitude;
  const int nearest = to_low < to_high ? low : to_high < to_low ? high : (low % 2 == 0 ? low : high);
  return sign | static_cast<uint8_t>(nearest);
}

at::Tensor reference_e4m3_codes(const at::Tensor& values) {
  const at::Tensor source = values.to(at::kFloat).contiguous();
  at::Tensor codes = at::empty(source.sizes(), at::kByte);
  const float* in = source.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  for (int64_t i = 0; i < source.numel(); ++i) out[i] = reference_e4m3_code(in[i]);
  return codes;
}

at::Tensor reference_e4m3_values(const at::Tensor& codes) {
  const at::Tensor source = codes.contiguous();
  at::Tensor values = at::empty(source.sizes(), at::kFloat);
  const uint8_t* in = source.data_ptr<uint8_t>();
  float* out = values.data_ptr<float>();
  for (int64_t i = 0; i < source.numel(); ++i) out[i] = static_cast<float>(reference_fp8_value(in[i], 4, 3, true));
  return values;
}

at::Tensor reference_int8_dequantized(const at::Tensor& weight) {
  const at::Tensor w = weight.to(at::kFloat);
  at::Tensor scale = w.abs().amax(1, /*keepdim=*/true) / 127.0f;
  scale = at::where(scale == 0, at::ones_like(scale), scale);
  return (w / scale).round().clamp(-127, 127) * scale;
}

void write_fp8_checkpoint(const std::string& src_dir, const std::string& dst_dir, Fp8Scales scales) {
  const io::ComponentFolder folder = io::open_component(src_dir, "transformer");
  auto model = models::create_transformer(folder);
  const auto linear_weights = linear_weight_names(*model);
  const io::Checkpoint checkpoint = folder.weights();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, io::StDtype> stored_as;
  for (const std::string& name : checkpoint.names()) {
    at::Tensor value = checkpoint.read(name, at::kFloat);
    if (std::find(linear_weights.begin(), linear_weights.end(), name) == linear_weights.end()) {
      tensors.emplace_back(name, value);
      continue;
    }
    at::Tensor scale;
    if (scales == Fp8Scales::PerRow) scale = value.abs().amax(1) / 448.0f;
    if (scales == Fp8Scales::PerTensor) scale = value.abs().max() / 448.0f;
    const at::Tensor scaled = scale.defined() ? value / (scale.dim() == 1 ? scale.unsqueeze(1) : scale) : value;
    tensors.emplace_back(name, reference_e4m3_codes(scaled));
    stored_as[name] = io::StDtype::F8_E4M3;
    if (scale.defined()) tensors.emplace_back(name.substr(0, name.size() - 7) + ".weight_scale", scale);
  }
  write_config(dst_dir, folder.config);
  io::save_safetensors(dst_dir + "/diffusion_pytorch_model.safetensors", tensors, {}, stored_as);
}

void write_random_transformer(const std::string& src_dir, const std::string& dst_dir, int64_t heads, uint64_t seed) {
  const io::ComponentFolder source = io::open_component(src_dir, "transformer");
  nlohmann::json config = source.config;
  config["num_attention_heads"] = heads;
  write_config(dst_dir, config);
  auto model = models::create_transformer(io::open_component(dst_dir, "transformer"));
  const parallel::ResolvedPlan plan = model->resolve(2);
  at::manual_seed(seed);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const parallel::ShardSpec& spec : plan.parameters) {
    // Norm scales near 1 (as trained ones are), the rest small.
    const bool norm_scale = spec.full_shape.size() == 1 && spec.parameter.find("norm") != std::string::npos;
    at::Tensor value = norm_scale ? 1 + 0.1 * at::randn(spec.full_shape) : 0.05 * at::randn(spec.full_shape);
    if (spec.dim == 1) value[0][spec.full_shape[1] - 1] = 0.5;  // 10 sigma: row 0's largest, on the last rank
    tensors.emplace_back(spec.parameter, value);
  }
  io::save_safetensors(dst_dir + "/diffusion_pytorch_model.safetensors", tensors);
}

}  // namespace shardit::testing
