#include "shardit/nn/weight_storage.h"

#include <fnmatch.h>

#include <algorithm>

#include "shardit/nn/module.h"

namespace shardit::nn {

std::string module_of_weight(const std::string& parameter) {
  const std::string suffix = ".weight";
  if (parameter.size() <= suffix.size() ||
      parameter.compare(parameter.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return "";
  }
  return parameter.substr(0, parameter.size() - suffix.size());
}

bool quantizes_on_load(const std::string& parameter, WeightsDtype weights,
                       const std::vector<std::string>& keep_in_fp32_modules,
                       const std::vector<std::string>& keep_high_precision, bool quantize_kept) {
  if (weights == WeightsDtype::Checkpoint || keeps_fp32(parameter, keep_in_fp32_modules)) return false;
  if (quantize_kept) return true;
  const std::string module = module_of_weight(parameter);
  // fnmatch(3) without flags: `*` stands for any run of characters, dots included.
  return std::none_of(keep_high_precision.begin(), keep_high_precision.end(),
                      [&](const std::string& glob) { return ::fnmatch(glob.c_str(), module.c_str(), 0) == 0; });
}

WeightStorage weight_storage(io::StDtype stored, bool has_scale, bool quantize, WeightsDtype weights) {
  WeightStorage storage;
  if (io::st_dtype_is_fp8(stored)) {
    storage.format = stored == io::StDtype::F8_E4M3 ? WeightFormat::Fp8E4M3 : WeightFormat::Fp8E5M2;
    storage.stored_quantized = true;
  } else if (stored == io::StDtype::I8 && has_scale) {
    storage.format = WeightFormat::Int8;
    storage.stored_quantized = true;
  } else if (quantize) {
    storage.format = weights == WeightsDtype::Fp8 ? WeightFormat::Fp8E4M3 : WeightFormat::Int8;
  }
  return storage;
}

}  // namespace shardit::nn
