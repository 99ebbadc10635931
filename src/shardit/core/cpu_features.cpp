#include "shardit/core/cpu_features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <cstdint>

namespace shardit {

namespace {

CpuFeatures read_cpu_features() {
  CpuFeatures features;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return features;
  const bool osxsave = (c >> 27) & 1;
  const bool fma = (c >> 12) & 1;
  uint64_t xcr0 = 0;
  if (osxsave) {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  // The OS saves the YMM state (bits 1, 2) and, for AVX-512, the opmask and ZMM state (5, 6, 7).
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  const bool os_avx512 = (xcr0 & 0xe6) == 0xe6;
  const bool os_amx = ((xcr0 >> 17) & 3) == 3;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return features;
  features.fma = os_avx && fma;
  features.avx2 = os_avx && ((b >> 5) & 1);
  features.avx512f = os_avx512 && ((b >> 16) & 1);
  features.avx512_bw_dq_vl = features.avx512f && ((b >> 17) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1);
  features.avx512_vnni = features.avx512f && ((c >> 11) & 1);
  features.amx_bf16 = os_amx && ((d >> 22) & 1);
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) != 0) features.avx512_bf16 = features.avx512f && ((a1 >> 5) & 1);
#endif
  return features;
}

}  // namespace

std::string CpuFeatures::to_string() const {
  std::string out;
  const auto add = [&out](bool present, const char* name) {
    if (!present) return;
    if (!out.empty()) out += ' ';
    out += name;
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(avx512f, "avx512f");
  add(avx512_vnni, "avx512_vnni");
  add(avx512_bf16, "avx512_bf16");
  add(amx_bf16, "amx_bf16");
  return out.empty() ? "none" : out;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = read_cpu_features();
  return features;
}

}  // namespace shardit
