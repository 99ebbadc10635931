// The main of every test executable: GoogleTest's, after the start every shardit program makes
// (nn::start_program: OpenBLAS on the kernels for this CPU, the instruction-set cap), so a test
// computes with the kernels of the CLI and the ranks it compares with, and after the rank forker
// of run_ranks is started (support/multiprocess.h).
#include <gtest/gtest.h>

#include <csignal>

#include "shardit/nn/program_start.h"
#include "support/multiprocess.h"

int main(int argc, char** argv) {
  shardit::nn::start_program(argv);
  // As the CLI: a write to a peer that is gone is an error to report, not a silent death (a rank
  // that outlives a lost peer must say which rank it lost).
  ::signal(SIGPIPE, SIG_IGN);
  // Returns in this process, and later in every rank that run_ranks forks, with the rank's argv.
  shardit::testing::start_rank_forker(argc, argv);
  shardit::testing::record_worker_tests();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
