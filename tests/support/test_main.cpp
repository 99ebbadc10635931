// The main of every test executable: GoogleTest's, after the program is made to run OpenBLAS's
// kernels for this CPU as every shardit program does (nn::exec_with_cpu_blas_kernels), so a test
// computes with the kernels of the CLI and the ranks it compares with.
#include <gtest/gtest.h>

#include "shardit/nn/gemm.h"

int main(int argc, char** argv) {
  shardit::nn::exec_with_cpu_blas_kernels(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
