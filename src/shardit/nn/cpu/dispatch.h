#pragma once
// The one place that decides which instruction sets shardit's CPU kernels may use (CTranslate2's
// cpu_isa): what this CPU and its OS grant (cpuid; the vector state the OS saves, read from XCR0;
// the AMX tile state, which Linux hands a process only on request), capped by the one variable
// SHARDIT_CPU_ISA. The fused kernels (fused.h), the AMX GEMM (amx_gemm.h), the bf16 attention
// kernels (bf16_attention.h) and auto's GEMM choice (gemm.h, blas_core.h) ask it; none of them
// tests a CPU feature itself. Decided once per process from the machine and the environment, never
// from a timing, so the kernels, and the bits, are the same on every run of a build on a machine.
#include <string>

namespace shardit::nn::cpu {

/// The instruction-set levels the kernels are built for, each including the ones before it.
enum class CpuIsa {
  Generic,     ///< no vector extension assumed (at::vec's portable loops)
  Avx2,        ///< AVX2 with FMA
  Avx512,      ///< AVX-512 F, BW, DQ and VL with FMA (what at::vec's AVX512 build assumes)
  Avx512Bf16,  ///< and AVX512-BF16 (Cooper Lake, Sapphire Rapids, AMD Zen 4)
  Amx,         ///< and AMX-BF16 tiles (Sapphire Rapids and later)
};

/// "generic", "avx2", "avx512", "avx512_bf16", "amx".
const char* cpu_isa_name(CpuIsa isa);

/// The level named `name`; an error naming `source` (where the name came from) and listing the
/// names otherwise.
CpuIsa parse_cpu_isa(const std::string& name, const std::string& source);

/// The highest level this CPU and OS grant (the AMX tile state is requested here, once).
CpuIsa granted_cpu_isa();

/// The level every CPU kernel uses: granted_cpu_isa(), lowered to SHARDIT_CPU_ISA when that is set
/// (a value above the grant changes nothing). A value that names no level is an error naming the
/// variable and listing the levels, raised at the first call (programs call it at start-up).
CpuIsa cpu_isa();

/// Whether the kernels may use `isa` (it is at most cpu_isa()).
bool cpu_isa_allows(CpuIsa isa);

/// Why the kernels may not use `isa`, for refusals ("" when they may): what the CPU lacks, the
/// state the OS did not grant, or the SHARDIT_CPU_ISA cap.
std::string cpu_isa_refusal(CpuIsa isa);

/// One line for start-up messages and the bench: "avx512_bf16 (cpu: avx2 fma avx512f avx512_vnni
/// avx512_bf16)", with ", capped by SHARDIT_CPU_ISA=avx2" when the variable lowers it.
std::string cpu_isa_summary();

}  // namespace shardit::nn::cpu
