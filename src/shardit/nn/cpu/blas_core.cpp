#include "shardit/nn/cpu/blas_core.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>

#include "shardit/nn/cpu/dispatch.h"

namespace shardit::nn::cpu {

int cpu_vector_level() {
  if (cpu_isa_allows(CpuIsa::Avx512)) return 3;
  return cpu_isa_allows(CpuIsa::Avx2) ? 2 : 1;
}

std::string blas_core_name() {
  using CoreName = char* (*)();
  const auto core_name = reinterpret_cast<CoreName>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (core_name == nullptr) return "";
  const char* name = core_name();
  return name == nullptr ? "" : name;
}

int blas_vector_level(const std::string& core_name) {
  std::string name;
  for (char c : core_name) name += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* avx512 : {"skylakex", "cooperlake", "sapphirerapids"}) {
    if (name == avx512) return 3;
  }
  for (const char* avx2 : {"haswell", "zen", "excavator"}) {
    if (name == avx2) return 2;
  }
  for (const char* older : {"prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "sandybridge",
                            "bulldozer", "piledriver", "steamroller", "barcelona", "opteron", "katmai",
                            "coppermine", "northwood", "athlon", "bobcat", "nano"}) {
    if (name == older) return 1;
  }
  return 0;
}

std::string better_blas_core() {
  const int blas_level = blas_vector_level(blas_core_name());
  const int cpu_level = cpu_vector_level();
  if (blas_level == 0 || blas_level >= cpu_level) return "";
  return cpu_level == 3 ? "SkylakeX" : (cpu_level == 2 ? "Haswell" : "");
}

void run_on_cpu_blas_kernels(char** argv) {
  // SHARDIT_KEEP_BLAS_CORE: the user's way to keep OpenBLAS's own choice, and the guard against
  // executing again when a build of OpenBLAS lacks the core asked for.
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr || std::getenv("SHARDIT_KEEP_BLAS_CORE") != nullptr) return;
  const std::string core = better_blas_core();
  if (core.empty()) return;
  ::setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  ::setenv("SHARDIT_KEEP_BLAS_CORE", "1", 1);
  ::execv("/proc/self/exe", argv);
  // The exec failed (no /proc): run on with OpenBLAS's own choice, as the ranks it starts will.
  ::unsetenv("OPENBLAS_CORETYPE");
  ::unsetenv("SHARDIT_KEEP_BLAS_CORE");
}

}  // namespace shardit::nn::cpu
