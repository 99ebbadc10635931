#pragma once
// The instruction sets of the CPU this process runs on, read once from cpuid (and the OS's
// XSAVE state: an AVX-512 CPU whose OS does not save the registers cannot use them). What the
// kernel choices are made from, so they depend on the machine, never on its load.
#include <string>

namespace shardit {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  /// AVX-512 F with BW, DQ and VL (Skylake-SP and later): what at::vec's AVX512 build assumes.
  bool avx512_bw_dq_vl = false;
  bool avx512_vnni = false;
  bool avx512_bf16 = false;
  bool amx_bf16 = false;

  /// 3: AVX-512, 2: AVX2 with FMA, 1: older (or not x86).
  int vector_level() const { return avx512f ? 3 : (avx2 && fma ? 2 : 1); }
  /// "avx2 fma avx512f avx512_vnni avx512_bf16" (those present), or "none".
  std::string to_string() const;
};

/// This CPU's features (read on the first call).
const CpuFeatures& cpu_features();

}  // namespace shardit
