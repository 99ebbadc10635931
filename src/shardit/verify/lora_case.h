#pragma once
// The golden LoRA cases (lora_*/case.json): which adapter files are loaded under which names,
// the set_adapters weights and fuse_lora's lora_scale, so a test runs what diffusers ran.
#include <memory>
#include <string>
#include <vector>

#include "shardit/parallel/lora.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::verify {

struct LoraCaseAdapter {
  std::string name;  ///< adapter_name
  std::string file;  ///< absolute path of the adapter file
};

struct LoraCase {
  std::vector<LoraCaseAdapter> adapters;  ///< in load order
  std::vector<std::string> active;        ///< set_adapters names
  std::vector<double> weights;            ///< set_adapters weights
  double lora_scale = 1.0;                ///< fuse_lora(lora_scale) and the runtime scale of sample_scaled
};

/// Reads `<dir>/case.json`; errors name the file and the missing field.
LoraCase read_lora_case(const std::string& dir);

/// Converts and loads the case's adapters into `model` (loaded) and activates them as the case
/// did; the runtime scale is left at 1.
std::unique_ptr<parallel::LoraAdapters> load_lora_case(parallel::TensorParallelModule& model, const LoraCase& lora_case);

}  // namespace shardit::verify
