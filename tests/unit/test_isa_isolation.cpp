// No vector code built for an instruction set beyond the baseline runs outside the kernels chosen
// for it. The kernels' translation units are compiled with -m flags (AVX2, AVX-512, AVX512-BF16,
// AMX) and called only where nn/cpu/dispatch.h allows; but an inline library function they
// instantiate (a std:: or c10 template, an inline helper of a shared header) is a weak symbol, and
// the linker may keep their copy for the whole program, where the generic path would then fault on
// a CPU without those instructions. So in the CLI, every function that holds a VEX or EVEX
// instruction must be one of those units' own functions (a strong symbol of their object files) or
// sit in one of at::vec's per-ISA namespaces (AVX2, AVX512, AVX512_BF16: ATen's CPU_CAPABILITY
// convention, which gives each ISA's instantiations names of their own).
#include <cxxabi.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace test_isa_isolation {
namespace {

/// Runs `command`, calling `line` on each line of its standard output; its exit status.
template <class OnLine>
int each_output_line(const std::string& command, OnLine line) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  if (pipe == nullptr) return -1;
  std::string current;
  char buffer[1 << 16];
  size_t read = 0;
  while ((read = std::fread(buffer, 1, sizeof(buffer), pipe.get())) > 0) {
    for (size_t i = 0; i < read; ++i) {
      if (buffer[i] != '\n') {
        current += buffer[i];
        continue;
      }
      line(current);
      current.clear();
    }
  }
  if (!current.empty()) line(current);
  return ::pclose(pipe.release());
}

std::string demangled(const std::string& symbol) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(symbol.c_str(), nullptr, nullptr, &status),
                                               std::free);
  return status == 0 && name != nullptr ? std::string(name.get()) : symbol;
}

/// The object files of the per-ISA sources (tests/CMakeLists.txt writes their list).
std::vector<std::string> isa_objects() {
  std::vector<std::string> objects;
  std::ifstream list(SHARDIT_ISA_OBJECTS_FILE);
  for (std::string path; std::getline(list, path);) {
    if (!path.empty()) objects.push_back(path);
  }
  return objects;
}

/// Whether an objdump instruction line ("  4011a0:\tvmovups %zmm0,(%rax)") is VEX or EVEX encoded:
/// an AVX mnemonic (v..., but VERR/VERW, which are older) or a ymm, zmm or mask register.
bool is_vector_extension(const std::string& line) {
  const size_t tab = line.find('\t');
  if (tab == std::string::npos) return false;
  const std::string instruction = line.substr(tab + 1);
  const bool avx_mnemonic = instruction.size() > 1 && instruction[0] == 'v' && instruction.rfind("verr", 0) != 0 &&
                            instruction.rfind("verw", 0) != 0;
  return avx_mnemonic || instruction.find("%ymm") != std::string::npos ||
         instruction.find("%zmm") != std::string::npos || instruction.find("%k") != std::string::npos;
}

bool in_isa_namespace(const std::string& name) {
  for (const char* isa : {"::AVX2::", "::AVX512::", "::AVX512_BF16::"}) {
    if (name.find(isa) != std::string::npos) return true;
  }
  return false;
}

TEST(IsaIsolation, VectorCodeOnlyInItsKernels) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "the per-ISA kernels are built on x86-64 only";
#else
  const std::vector<std::string> objects = isa_objects();
  ASSERT_FALSE(objects.empty()) << SHARDIT_ISA_OBJECTS_FILE << " lists no per-ISA object file";
  // The strong text symbols the per-ISA units define: their own functions.
  std::set<std::string> own;
  for (const std::string& object : objects) {
    const int status = each_output_line("nm --defined-only '" + object + "'", [&](const std::string& line) {
      std::istringstream fields(line);
      std::string address, type, symbol;
      if (fields >> address >> type >> symbol && (type == "t" || type == "T")) own.insert(symbol);
    });
    ASSERT_EQ(status, 0) << "nm failed on " << object;
  }

  std::set<std::string> leaked;
  int64_t kernel_functions_with_vector_code = 0;
  std::string function;
  bool counted = false;
  const std::string cli = shardit::testing::cli_path();
  const int status = each_output_line("objdump -d --no-show-raw-insn '" + cli + "'", [&](const std::string& line) {
    // "0000000000401000 <symbol>:" starts a function.
    if (!line.empty() && line.back() == ':' && line.find(" <") != std::string::npos) {
      function = line.substr(line.find(" <") + 2, line.size() - line.find(" <") - 4);
      counted = false;
      return;
    }
    if (function.empty() || counted || !is_vector_extension(line)) return;
    counted = true;
    if (own.count(function) != 0) {
      ++kernel_functions_with_vector_code;
    } else if (!in_isa_namespace(demangled(function))) {
      leaked.insert(demangled(function));
    }
  });
  ASSERT_EQ(status, 0) << "objdump failed on " << cli;
  // The check sees the kernels' own vector code, so it cannot pass for want of reading it.
  EXPECT_GT(kernel_functions_with_vector_code, 0) << "no vector code found in the kernels' own functions";
  std::string names;
  for (const std::string& name : leaked) names += "\n  " + name;
  EXPECT_TRUE(leaked.empty()) << leaked.size()
                              << " function(s) outside the per-ISA kernels hold vector-extension code (a library "
                                 "inline instantiated under -m flags and kept by the linker?):"
                              << names;
#endif
}

}  // namespace
}  // namespace test_isa_isolation
