#pragma once
// Whether a Linear weight is kept dense or stored in 8 bits once loaded (nn/quantized_weight.h),
// and in which format: a checkpoint's own 8-bit weights stay 8-bit; quantize-on-load
// (`--weights-dtype fp8|int8`) stores the other Linear weights in 8 bits, but those of the
// modules a model keeps in high precision or in fp32. The loader (parallel/) asks here.
#include <string>
#include <vector>

#include "shardit/io/safetensors.h"
#include "shardit/nn/quantized_weight.h"

namespace shardit::nn {

/// "a.b" for the weight "a.b.weight"; "" for a name without that suffix.
std::string module_of_weight(const std::string& parameter);

/// Whether quantize-on-load to `weights` stores the Linear weight `parameter` ("a.b.weight" of a
/// Linear) in 8 bits: not for Checkpoint, under a module of `keep_in_fp32_modules` (keeps_fp32),
/// or (unless `quantize_kept`) for a module matching one of `keep_high_precision`, module-path
/// globs with `*` standing for any run of characters ("transformer_blocks.*.norm1.linear").
bool quantizes_on_load(const std::string& parameter, WeightsDtype weights,
                       const std::vector<std::string>& keep_in_fp32_modules,
                       const std::vector<std::string>& keep_high_precision, bool quantize_kept);

/// How one Linear weight is stored once loaded.
struct WeightStorage {
  WeightFormat format = WeightFormat::Dense;
  /// The codes are read as stored (an F8 or scaled I8 tensor); otherwise a weight of an 8-bit
  /// format is a dense tensor quantized while it is read.
  bool stored_quantized = false;
};

/// The storage of a Linear weight the checkpoint holds as `stored`, with a scale tensor beside it
/// (`has_scale`) or not; `quantize`: quantize-on-load to `weights` takes it (quantizes_on_load).
/// F8_E4M3 and F8_E5M2 weights keep their format and an I8 weight with a scale is int8, as stored;
/// a weight quantize-on-load takes becomes Fp8E4M3 (weights Fp8) or Int8; the rest stay dense.
WeightStorage weight_storage(io::StDtype stored, bool has_scale, bool quantize, WeightsDtype weights);

}  // namespace shardit::nn
