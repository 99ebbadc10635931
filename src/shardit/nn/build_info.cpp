#include "shardit/nn/build_info.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Version.h>
#include <torch/version.h>

#include <dlfcn.h>

#include <filesystem>
#include <regex>

#if SHARDIT_WITH_NCCL
#include <nccl.h>
#endif

#include "shardit/core/cpu_features.h"
#include "shardit/nn/attention/backends.h"
#include "shardit/nn/attention/bf16_kernels.h"
#include "shardit/nn/cpu/dispatch.h"
#include "shardit/nn/cpu/fused.h"
#include "shardit/nn/gemm.h"

// Set by CMake for this file alone (src/shardit/CMakeLists.txt).
#ifndef SHARDIT_VERSION
#error "SHARDIT_VERSION is not defined: the build defines it for build_info.cpp"
#endif
#ifndef SHARDIT_CUDA_VERSION
#error "SHARDIT_CUDA_VERSION is not defined: the build defines it for build_info.cpp"
#endif

namespace shardit::nn {

namespace {

/// `key`'s value in LibTorch's build settings ("..., TORCH_VERSION=2.15.0, ..."), "" without it.
std::string build_setting(const std::string& config, const std::string& key) {
  const std::regex pattern("[ ,]" + key + "=([^,\\n]*)");
  std::smatch match;
  return std::regex_search(config, match, pattern) ? match[1].str() : "";
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

std::string running_libtorch_version() {
  const std::string from_settings = build_setting(at::show_config(), "TORCH_VERSION");
  if (!from_settings.empty()) return from_settings;
  // Debian's LibTorch 1.13 leaves TORCH_VERSION out of its settings; its file is versioned.
  Dl_info info{};
  if (::dladdr(reinterpret_cast<const void*>(&at::show_config), &info) != 0 && info.dli_fname != nullptr) {
    std::error_code error;
    const std::string file = std::filesystem::canonical(info.dli_fname, error).filename().string();
    std::smatch match;
    if (!error && std::regex_search(file, match, std::regex("\\.so\\.([0-9][0-9.]*)$"))) return match[1].str();
  }
  return "unknown";
}

std::vector<std::pair<std::string, std::string>> build_facts() {
  const std::string config = at::show_config();
  std::string cuda = SHARDIT_CUDA_VERSION;
  if (cuda.empty()) {
    cuda = "none";
  } else if (const std::string torch_cuda = build_setting(config, "CUDA_VERSION"); !torch_cuda.empty()) {
    cuda += " (LibTorch built for " + torch_cuda + ")";
  }
#if SHARDIT_WITH_NCCL
  const std::string nccl = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH);
  const std::string collectives = "gloo (CPU tensors), nccl (CUDA tensors)";
#else
  const std::string nccl = "none";
  const std::string collectives = "gloo (CPU tensors)";
#endif
  const bool cuda_device = at::hasCUDA();
  return {
      {"shardit", SHARDIT_VERSION},
      {"libtorch_built", TORCH_VERSION},
      {"libtorch_running", running_libtorch_version()},
      {"cuda", cuda},
      {"nccl", nccl},
      {"collectives", collectives},
      {"cuda_device", cuda_device ? "yes" : "none"},
      {"cpu_features", cpu_features().to_string()},
      {"cpu_isa", cpu::cpu_isa_summary()},
      {"attention_backends", joined(attention_backend_names())},
      {"attention_cpu_auto", joined(default_attention_backends(c10::DeviceType::CPU))},
      {"fp32_attention_on", cpu_attention_backend(at::kFloat)},
      {"bf16_attention_on", cpu_bf16_attention_backend()},
      {"fp32_products_on", gemm_kernel_summary()},
      {"fused_cpu_kernels", cpu::fused_kernels_name()},
  };
}

nlohmann::json build_facts_json() {
  nlohmann::json facts = nlohmann::json::object();
  for (const auto& [name, value] : build_facts()) facts[name] = value;
  return facts;
}

}  // namespace shardit::nn
