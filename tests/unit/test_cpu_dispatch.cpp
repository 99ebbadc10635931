// The one instruction-set dispatch of the CPU kernels (nn/cpu/dispatch.h): its levels, what this
// CPU grants, the SHARDIT_CPU_ISA cap as every kernel family sees it, and the refusals.
#include <gtest/gtest.h>

#include <string>

#include "shardit/nn/cpu/amx_gemm.h"
#include "shardit/nn/cpu/bf16_attention.h"
#include "shardit/nn/cpu/dispatch.h"
#include "shardit/nn/cpu/fused.h"
#include "support/test_support.h"

namespace test_cpu_dispatch {
namespace {

using shardit::nn::cpu::CpuIsa;
namespace cpu = shardit::nn::cpu;

constexpr CpuIsa kLevels[] = {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512, CpuIsa::Avx512Bf16, CpuIsa::Amx};

TEST(CpuDispatch, NamesRoundTripAndABadNameListsThem) {
  for (const CpuIsa isa : kLevels) EXPECT_EQ(cpu::parse_cpu_isa(cpu::cpu_isa_name(isa), "test"), isa);
  const std::string message = shardit::testing::error_of([] { cpu::parse_cpu_isa("avx1024", "SHARDIT_CPU_ISA"); });
  EXPECT_NE(message.find("SHARDIT_CPU_ISA is 'avx1024'"), std::string::npos) << message;
  EXPECT_NE(message.find("generic, avx2, avx512, avx512_bf16, amx"), std::string::npos) << message;
}

TEST(CpuDispatch, RefusalsFollowTheGrantedLevel) {
  // This process runs without a cap (the suite does not set SHARDIT_CPU_ISA).
  EXPECT_EQ(cpu::cpu_isa(), cpu::granted_cpu_isa());
  for (const CpuIsa isa : kLevels) {
    const std::string refusal = cpu::cpu_isa_refusal(isa);
    EXPECT_EQ(refusal.empty(), isa <= cpu::cpu_isa()) << cpu::cpu_isa_name(isa) << ": " << refusal;
    EXPECT_EQ(cpu::cpu_isa_allows(isa), isa <= cpu::cpu_isa());
  }
  EXPECT_TRUE(cpu::cpu_isa_refusal(CpuIsa::Generic).empty());
  // Each kernel family asks the dispatch: a level it may not use is refused with the dispatch's reason.
  if (!cpu::cpu_isa_allows(CpuIsa::Amx)) {
    EXPECT_FALSE(cpu::amx_gemm_available());
  }
  if (!cpu::cpu_isa_allows(CpuIsa::Avx512Bf16)) {
    EXPECT_NE(cpu::bf16_attention_kernel_unavailable_reason(cpu::Bf16AttentionKernel::avx512_bf16)
                  .find(cpu::cpu_isa_refusal(CpuIsa::Avx512Bf16)),
              std::string::npos);
  }
  const std::string best = cpu::fused_kernel_builds().front();
  if (cpu::cpu_isa_allows(CpuIsa::Avx512Bf16)) {
    EXPECT_EQ(best, "avx512_bf16");
  } else if (cpu::cpu_isa_allows(CpuIsa::Avx512)) {
    EXPECT_EQ(best, "avx512");
  } else if (cpu::cpu_isa_allows(CpuIsa::Avx2)) {
    EXPECT_EQ(best, "avx2");
  } else {
    EXPECT_EQ(best, "default");
  }
}

/// The kernels line of `generate` on the built-in tiny pipeline, with `environment` before the CLI.
std::string kernels_line(const std::string& environment, int* status) {
  const std::string dir = shardit::testing::make_temp_dir("cpu-dispatch");
  std::string output;
  *status = shardit::testing::run_command(environment + " " + shardit::testing::cli_path() +
                                              " generate --height 64 --width 64 --steps 1 --dtype bf16 --out " + dir +
                                              "/image.png",
                                          &output);
  return output;
}

TEST(CpuDispatch, OneVariableCapsEveryKernel) {
  int status = 0;
  const std::string generic = kernels_line("SHARDIT_CPU_ISA=generic", &status);
  ASSERT_EQ(status, 0) << generic;
  EXPECT_NE(generic.find("fused element-wise kernels: default"), std::string::npos) << generic;
  EXPECT_NE(generic.find("bf16 attention on memory_efficient"), std::string::npos) << generic;
  EXPECT_NE(generic.find("kernels generic (cpu:"), std::string::npos) << generic;
  if (cpu::granted_cpu_isa() > CpuIsa::Generic) {
    EXPECT_NE(generic.find("capped by SHARDIT_CPU_ISA"), std::string::npos) << generic;
  }
  const std::string bad = kernels_line("SHARDIT_CPU_ISA=avx1024", &status);
  EXPECT_NE(status, 0) << bad;
  EXPECT_NE(bad.find("SHARDIT_CPU_ISA is 'avx1024'"), std::string::npos) << bad;
}

}  // namespace
}  // namespace test_cpu_dispatch
