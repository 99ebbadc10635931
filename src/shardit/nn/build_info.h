#pragma once
// What this build of shardit is and what it computes with on this machine: its version, the
// LibTorch it was built with and the one it runs with, the CUDA and NCCL compiled in, the
// collective backends, the CPU's features and the kernels the current selections take. `shardit
// version` prints it; the bench writes it into its JSON.
#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

namespace shardit::nn {

/// The facts as (name, value) pairs, in the order `shardit version` prints them: shardit,
/// libtorch_built, libtorch_running, cuda, nccl, collectives, cuda_device, cpu_features, cpu_isa,
/// attention_backends, attention_cpu_auto, bf16_attention_on, fp32_products_on, fused_cpu_kernels.
std::vector<std::pair<std::string, std::string>> build_facts();

/// build_facts() as one JSON object.
nlohmann::json build_facts_json();

/// The version of the LibTorch this process runs with (which may differ from the headers it was
/// built with): TORCH_VERSION from LibTorch's own build settings (at::show_config), else the
/// version in the loaded libtorch_cpu's file name (Debian's libtorch_cpu.so.1.13.0), else
/// "unknown".
std::string running_libtorch_version();

}  // namespace shardit::nn
