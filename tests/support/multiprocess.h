#pragma once
// Multi-process gtest cases: the test executable runs again as N ranks on this host (forked by the
// rank forker, see start_rank_forker), each rank running only the current test.
//
//   TEST(DistThing, TwoRanks) {              // run_on_ranks: the function runs on every rank
//     const shardit::testing::RanksRun run = shardit::testing::run_on_ranks(2, [](const RankContext& ranks) {
//       World& world = World::init();         // what a rank does is code here: world.rank() == 1, ...
//       ... collectives, EXPECTs, files written under ranks.dir ...
//     });
//     EXPECT_EQ(run.exit_code, 0);            // then read what the ranks wrote under run.dir
//   }
//
//   TEST(DistThing, TwoRanks) {              // the older form: the test body branches on is_worker()
//     if (shardit::testing::is_worker()) {
//       ... rank code: World::init(), collectives, EXPECTs ...
//       return;
//     }
//     EXPECT_EQ(shardit::testing::run_ranks(2), 0);
//   }
//
// The worker's filter is the running test's own name, and every worker records in a folder that it
// started the test (and whether it then skipped it); the parent fails the test unless each of the N
// workers started it and none skipped it. So a worker that runs no test, or skips, never passes.
// A worker's failed EXPECT makes it exit non-zero, which makes run_ranks return non-zero. Results
// that the parent must inspect go through files in run_on_ranks' folder (RankContext::dir).
#include <functional>
#include <map>
#include <string>

namespace shardit::testing {

/// Called by the tests' main before GoogleTest starts. In a test process (not a worker) it starts
/// the rank forker: a process forked before any thread exists, which forks each rank of
/// run_ranks from its state (LibTorch's ~0.35 CPU-s of static initialisation already done, the
/// environment and descriptors set per rank) instead of executing the test program again; it
/// returns there at once. It also returns in every rank forked later, with `argc`/`argv` set to
/// the rank's command line, to run the test as a worker. SHARDIT_TEST_EXEC_RANKS=1 turns the
/// forker off: run_ranks then executes the program for each rank, as before.
void start_rank_forker(int& argc, char**& argv);

/// In a worker, records in the run's folder which test it ran (see WorkerRecord). Called by the
/// tests' main, after start_rank_forker, before GoogleTest starts.
void record_worker_tests();

/// True inside a rank started by run_ranks (or by another launcher with SHARDIT_TEST_WORKER=1).
bool is_worker();

/// The full name of the running test ("Suite.Name", "Prefix/Suite.Name/0"), which as a
/// --gtest_filter selects exactly that test. Throws outside a test body.
std::string current_test_name();

/// The record of which test the workers of one launch ran. Make one in the parent, pass env() to
/// the workers (with --gtest_filter=current_test_name()), then call expect_ran().
class WorkerRecord {
 public:
  /// A fresh record folder for the running test.
  WorkerRecord();
  /// SHARDIT_TEST_WORKER=1 and the record folder, for the workers' environment.
  std::map<std::string, std::string> env() const;
  /// Adds a test failure unless exactly `nproc` workers started the running test and none of them
  /// skipped it.
  void expect_ran(int nproc) const;

 private:
  std::string test_;
  std::string dir_;
};

/// Runs this test executable, filtered to the running test, as `nproc` local ranks (through
/// dist::launch_local, so each rank's output is prefixed "[r] "), with SHARDIT_TEST_WORKER=1 and
/// `extra_env` set. Returns the launcher's exit code (0 when every rank passed); adds a test
/// failure unless every rank started the test and none skipped it. `grace_seconds` (0: the
/// launcher's default) is how long the other ranks may run on after one fails before the launcher
/// kills them.
int run_ranks(int nproc, std::map<std::string, std::string> extra_env = {}, int grace_seconds = 0);

/// What run_on_ranks' function gets on each rank.
struct RankContext {
  /// A folder made for this run, shared by the ranks and the test process: what the test should
  /// inspect afterwards is written here.
  std::string dir;
};

/// The end of a run_on_ranks in the test process.
struct RanksRun {
  int exit_code = 0;  ///< the launcher's: 0 when every rank passed
  std::string dir;    ///< RankContext::dir
};

/// Runs `on_rank` on `nproc` local ranks, as c10d's multi-process tests run a test method on each
/// rank: the test executable runs again as the ranks (run_ranks), each filtered to the running test,
/// which reaches this same call and there runs `on_rank`, then exits (1 when one of its EXPECTs
/// failed, 0 otherwise), so that the call never returns on a rank. What each rank does is written in
/// `on_rank` (it branches on its rank), so no instruction travels through environment variables;
/// only the folder does, set by this fixture. In the test process it returns once every rank has
/// exited. Code before the call runs on the ranks too: keep it free of side effects.
/// `grace_seconds`: as run_ranks'.
RanksRun run_on_ranks(int nproc, const std::function<void(const RankContext&)>& on_rank, int grace_seconds = 0);

/// The value of an environment variable, or `fallback` when unset.
std::string env_or(const std::string& name, const std::string& fallback = "");

}  // namespace shardit::testing
