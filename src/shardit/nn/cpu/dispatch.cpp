#include "shardit/nn/cpu/dispatch.h"

#include <c10/util/Exception.h>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <array>
#include <cstdlib>
#include <optional>

#include "shardit/core/cpu_features.h"

namespace shardit::nn::cpu {

namespace {

constexpr std::array<CpuIsa, 5> kLevels = {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512, CpuIsa::Avx512Bf16,
                                           CpuIsa::Amx};
constexpr const char* kCapVariable = "SHARDIT_CPU_ISA";

/// Linux hands a process the AMX tile state (8 KiB of registers per thread) only when asked.
bool os_grants_tile_state() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchRequestXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kXfeatureTileData = 18;          // XFEATURE_XTILEDATA
  return ::syscall(SYS_arch_prctl, kArchRequestXcompPerm, kXfeatureTileData) == 0;
#else
  return false;
#endif
}

/// Why the CPU and OS do not grant `isa` ("" when they do). cpu_features() already leaves out
/// what the OS does not save (XCR0); the tile state is asked for once, here.
std::string hardware_refusal(CpuIsa isa) {
  const CpuFeatures& cpu = cpu_features();
  const std::string has = " (cpu: " + cpu.to_string() + ")";
  switch (isa) {
    case CpuIsa::Generic: return "";
    case CpuIsa::Avx2: return cpu.avx2 && cpu.fma ? "" : "this CPU has no AVX2 with FMA" + has;
    case CpuIsa::Avx512:
      return cpu.avx512_bw_dq_vl && cpu.fma ? "" : "this CPU has no AVX-512 (F, BW, DQ, VL) with FMA" + has;
    case CpuIsa::Avx512Bf16: {
      const std::string below = hardware_refusal(CpuIsa::Avx512);
      if (!below.empty()) return below;
      return cpu.avx512_bf16 ? "" : "this CPU has no AVX512-BF16" + has;
    }
    case CpuIsa::Amx: {
      if (!cpu.amx_bf16 || !cpu.avx512_bf16 || !cpu.avx512_bw_dq_vl) {
        return "this CPU has no AMX-BF16 with AVX512-BF16" + has;
      }
      static const bool granted = os_grants_tile_state();
      return granted ? "" : "the OS did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)";
    }
  }
  return "unknown instruction-set level";
}

/// SHARDIT_CPU_ISA's level, nullopt when unset or empty.
std::optional<CpuIsa> cap_from_environment() {
  const char* value = std::getenv(kCapVariable);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return parse_cpu_isa(value, kCapVariable);
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Generic: return "generic";
    case CpuIsa::Avx2: return "avx2";
    case CpuIsa::Avx512: return "avx512";
    case CpuIsa::Avx512Bf16: return "avx512_bf16";
    case CpuIsa::Amx: return "amx";
  }
  return "?";
}

CpuIsa parse_cpu_isa(const std::string& name, const std::string& source) {
  std::string names;
  for (const CpuIsa isa : kLevels) {
    if (name == cpu_isa_name(isa)) return isa;
    names += (names.empty() ? "" : ", ") + std::string(cpu_isa_name(isa));
  }
  TORCH_CHECK(false, source, " is '", name, "', which names no instruction-set level; choose one of ", names);
}

CpuIsa granted_cpu_isa() {
  static const CpuIsa granted = [] {
    CpuIsa best = CpuIsa::Generic;
    for (const CpuIsa isa : kLevels) {
      if (!hardware_refusal(isa).empty()) break;
      best = isa;
    }
    return best;
  }();
  return granted;
}

CpuIsa cpu_isa() {
  static const CpuIsa level = [] {
    const std::optional<CpuIsa> cap = cap_from_environment();
    return cap && *cap < granted_cpu_isa() ? *cap : granted_cpu_isa();
  }();
  return level;
}

bool cpu_isa_allows(CpuIsa isa) { return isa <= cpu_isa(); }

std::string cpu_isa_refusal(CpuIsa isa) {
  const std::string hardware = hardware_refusal(isa);
  if (!hardware.empty()) return hardware;
  if (cpu_isa_allows(isa)) return "";
  return std::string(kCapVariable) + "=" + cpu_isa_name(cpu_isa()) + " keeps the kernels below " + cpu_isa_name(isa);
}

std::string cpu_isa_summary() {
  std::string summary = std::string(cpu_isa_name(cpu_isa())) + " (cpu: " + cpu_features().to_string();
  if (cpu_isa() < granted_cpu_isa()) summary += ", capped by " + std::string(kCapVariable);
  return summary + ")";
}

}  // namespace shardit::nn::cpu
