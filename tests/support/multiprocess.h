#pragma once
// Multi-process gtest cases: the test executable re-runs itself as N ranks on this host.
//
//   TEST(DistThing, TwoRanks) {
//     if (shardit::testing::is_worker()) {
//       ... rank code: World::init(), collectives, EXPECTs ...
//       return;
//     }
//     EXPECT_EQ(shardit::testing::run_ranks(2, "DistThing.TwoRanks"), 0);
//   }
//
// A worker's failed EXPECT makes it exit non-zero, which makes run_ranks return non-zero. Results
// that the parent must inspect can go through files in a folder passed with `extra_env`.
#include <map>
#include <string>

namespace shardit::testing {

/// True inside a rank started by run_ranks (or by mpirun with SHARDIT_TEST_WORKER=1).
bool is_worker();

/// Runs this test executable with --gtest_filter=`test_name` as `nproc` local ranks (through
/// dist::launch_local, so each rank's output is prefixed "[r] "), with SHARDIT_TEST_WORKER=1 and
/// `extra_env` set. Returns 0 when every rank passed.
int run_ranks(int nproc, const std::string& test_name,
              std::map<std::string, std::string> extra_env = {});

/// The value of an environment variable, or `fallback` when unset.
std::string env_or(const std::string& name, const std::string& fallback = "");

}  // namespace shardit::testing
