// LaunchEnv: every launcher's conventions, their precedence, defaults, and the error for each bad
// value; the local launcher's failure notice (the value its SIGTERM carries).
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "shardit/dist/launch_env.h"
#include "shardit/dist/launcher.h"

#include <sys/wait.h>
#include <unistd.h>

namespace test_launch_env {
namespace {

using shardit::dist::LaunchEnv;
using shardit::dist::LaunchSource;
using Vars = std::map<std::string, std::string>;

std::string error_of(const Vars& vars) {
  try {
    LaunchEnv::from_variables(vars);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

void expect_env(const LaunchEnv& env, LaunchSource source, int rank, int world, int local_rank,
                int local_world, const std::string& addr, int port) {
  EXPECT_EQ(env.source, source);
  EXPECT_EQ(env.rank, rank);
  EXPECT_EQ(env.world_size, world);
  EXPECT_EQ(env.local_rank, local_rank);
  EXPECT_EQ(env.local_world_size, local_world);
  EXPECT_EQ(env.master_addr, addr);
  EXPECT_EQ(env.master_port, port);
}

TEST(LaunchEnv, NoVariablesIsRankZeroOfOne) {
  expect_env(LaunchEnv::from_variables({}), LaunchSource::Single, 0, 1, 0, 1, "", 0);
  // Unrelated variables change nothing.
  expect_env(LaunchEnv::from_variables({{"HOME", "/root"}, {"SLURM_JOB_ID", "7"}}),
             LaunchSource::Single, 0, 1, 0, 1, "", 0);
}

TEST(LaunchEnv, Torchrun) {
  const auto env = LaunchEnv::from_variables({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                              {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "node0"},
                                              {"MASTER_PORT", "29400"}});
  expect_env(env, LaunchSource::Torchrun, 5, 8, 1, 4, "node0", 29400);
  EXPECT_STREQ(shardit::dist::launch_source_name(env.source), "torchrun");
}

TEST(LaunchEnv, TorchrunWithoutLocalVariablesAssumesOneNode) {
  // No MASTER_ADDR: every rank is local, so rank 0's store is reached over loopback.
  expect_env(LaunchEnv::from_variables({{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_PORT", "1234"}}),
             LaunchSource::Torchrun, 2, 3, 2, 3, "", 1234);
}

TEST(LaunchEnv, TorchrunSingleRankNeedsNoPort) {
  expect_env(LaunchEnv::from_variables({{"RANK", "0"}, {"WORLD_SIZE", "1"}}), LaunchSource::Torchrun,
             0, 1, 0, 1, "", 0);
}

TEST(LaunchEnv, OpenMPI) {
  const auto env = LaunchEnv::from_variables(
      {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
       {"MASTER_ADDR", "10.0.0.1"}});
  // Default port for launchers that do not set one.
  expect_env(env, LaunchSource::OpenMPI, 3, 4, 1, 2, "10.0.0.1", 29500);
  EXPECT_STREQ(shardit::dist::launch_source_name(env.source), "openmpi");
}

TEST(LaunchEnv, OpenMPIAllLocalDefaultsToLoopback) {
  expect_env(LaunchEnv::from_variables({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MASTER_PORT", "4000"}}),
             LaunchSource::OpenMPI, 1, 2, 1, 2, "", 4000);
}

TEST(LaunchEnv, PMI) {
  expect_env(LaunchEnv::from_variables({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "2"},
                                        {"MPI_LOCALNRANKS", "3"}}),
             LaunchSource::PMI, 2, 3, 2, 3, "", 29500);
}

TEST(LaunchEnv, SlurmWithTasksPerNodeCount) {
  expect_env(LaunchEnv::from_variables({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"},
                                        {"SLURM_LOCALID", "2"}, {"SLURM_NTASKS_PER_NODE", "3"},
                                        {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "5000"}}),
             LaunchSource::Slurm, 5, 6, 2, 3, "n1", 5000);
}

TEST(LaunchEnv, SlurmTasksPerNodeList) {
  // "2(x2),1": nodes 0 and 1 run 2 tasks, node 2 runs 1.
  expect_env(LaunchEnv::from_variables({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "5"},
                                        {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x2),1"},
                                        {"SLURM_NODEID", "2"}, {"MASTER_ADDR", "n0"}}),
             LaunchSource::Slurm, 4, 5, 0, 1, "n0", 29500);
  expect_env(LaunchEnv::from_variables({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"},
                                        {"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "2(x2)"},
                                        {"MASTER_ADDR", "n0"}}),
             LaunchSource::Slurm, 1, 4, 1, 2, "n0", 29500);
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "3"},
                        {"SLURM_TASKS_PER_NODE", "2,1"}, {"MASTER_ADDR", "n0"}}),
            "SLURM_TASKS_PER_NODE='2,1' differs between nodes and SLURM_NODEID is not set; set "
            "SLURM_NTASKS_PER_NODE");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "3"},
                        {"SLURM_TASKS_PER_NODE", "2(3)"}}),
            "SLURM_TASKS_PER_NODE='2(3)' is malformed: expected entries like 2 or 2(x3)");
}

TEST(LaunchEnv, Precedence) {
  // torchrun > OpenMPI > PMI > Slurm: e.g. torchrun started inside an srun allocation.
  const Vars all = {{"RANK", "1"},         {"WORLD_SIZE", "2"},          {"MASTER_PORT", "7000"},
                    {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                    {"PMI_RANK", "4"},     {"PMI_SIZE", "5"},            {"SLURM_PROCID", "5"},
                    {"SLURM_NTASKS", "6"}};
  EXPECT_EQ(LaunchEnv::from_variables(all).source, LaunchSource::Torchrun);
  Vars rest = all;
  rest.erase("RANK");
  rest.erase("WORLD_SIZE");
  EXPECT_EQ(LaunchEnv::from_variables(rest).source, LaunchSource::OpenMPI);
  EXPECT_EQ(LaunchEnv::from_variables(rest).rank, 3);
  rest.erase("OMPI_COMM_WORLD_RANK");
  rest.erase("OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(LaunchEnv::from_variables(rest).source, LaunchSource::PMI);
  EXPECT_EQ(LaunchEnv::from_variables(rest).rank, 4);
  rest.erase("PMI_RANK");
  rest.erase("PMI_SIZE");
  EXPECT_EQ(LaunchEnv::from_variables(rest).source, LaunchSource::Slurm);
  EXPECT_EQ(LaunchEnv::from_variables(rest).rank, 5);
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}),
            "WORLD_SIZE=0 is invalid: the world needs at least 1 rank");
  EXPECT_EQ(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}),
            "RANK=2 is out of range for WORLD_SIZE=2 (expected 0..1)");
  EXPECT_EQ(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}),
            "RANK=-1 is negative: ranks count from 0");
  EXPECT_EQ(error_of({{"RANK", "one"}, {"WORLD_SIZE", "2"}}),
            "RANK='one' is not an integer; set it to a whole number or unset it");
  EXPECT_EQ(error_of({{"RANK", "1"}, {"WORLD_SIZE", "2x"}}),
            "WORLD_SIZE='2x' is not an integer; set it to a whole number or unset it");
  EXPECT_EQ(error_of({{"RANK", "1"}, {"WORLD_SIZE", ""}}),
            "WORLD_SIZE='' is not an integer; set it to a whole number or unset it");
  EXPECT_EQ(error_of({{"RANK", "1"}, {"WORLD_SIZE", "99999999999"}}),
            "WORLD_SIZE='99999999999' is not an integer; set it to a whole number or unset it");
  EXPECT_EQ(error_of({{"RANK", "1"}}),
            "WORLD_SIZE is not set, but RANK=1 is set (torchrun convention); set WORLD_SIZE as well, or "
            "unset RANK");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "2"}}),
            "RANK is not set, but WORLD_SIZE=2 is set (torchrun convention); set RANK as well, or unset "
            "WORLD_SIZE");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"},
                        {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}),
            "LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2 (expected 0..1)");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "-2"},
                        {"MASTER_PORT", "1"}}),
            "LOCAL_RANK=-2 is negative: local ranks count from 0");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "0"}}),
            "LOCAL_WORLD_SIZE=0 is invalid: a node runs at least 1 rank");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}),
            "LOCAL_WORLD_SIZE=3 is larger than WORLD_SIZE=2");
}

TEST(LaunchEnv, BadPortsNameTheVariable) {
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "abc"}}),
            "MASTER_PORT='abc' is not an integer; set it to a whole number or unset it");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
            "MASTER_PORT=70000 is out of range (expected 1..65535)");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}}),
            "MASTER_PORT=0 is out of range (expected 1..65535)");
  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                        {"MASTER_PORT", "-5"}}),
            "MASTER_PORT=-5 is out of range (expected 1..65535)");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}),
            "MASTER_PORT is not set but WORLD_SIZE=2: the ranks need a rendezvous port; set MASTER_PORT "
            "(torchrun sets it)");
}

TEST(LaunchEnv, MultiNodeNeedsMasterAddr) {
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"},
                        {"MASTER_PORT", "1"}}),
            "MASTER_ADDR is not set but the 4 ranks span several nodes (2 on this one); set MASTER_ADDR to "
            "the host of rank 0");
}

TEST(LaunchEnv, LauncherSpecificNamesInErrors) {
  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}}),
            "OMPI_COMM_WORLD_RANK=4 is out of range for OMPI_COMM_WORLD_SIZE=4 (expected 0..3)");
  EXPECT_EQ(error_of({{"PMI_RANK", "0"}, {"PMI_SIZE", "0"}}),
            "PMI_SIZE=0 is invalid: the world needs at least 1 rank");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "2"}}),
            "SLURM_PROCID='x' is not an integer; set it to a whole number or unset it");
  EXPECT_EQ(error_of({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "5"},
                        {"MPI_LOCALNRANKS", "2"}}),
            "MPI_LOCALRANKID=5 is out of range for MPI_LOCALNRANKS=2 (expected 0..1)");
}

TEST(LaunchEnv, FromEnvironmentReadsTheProcessEnvironment) {
  setenv("PMI_RANK", "1", 1);
  setenv("PMI_SIZE", "2", 1);
  const auto env = LaunchEnv::from_environment();
  unsetenv("PMI_RANK");
  unsetenv("PMI_SIZE");
  EXPECT_EQ(env.source, LaunchSource::PMI);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
}

// The notice a server reads from the launcher's SIGTERM names the rank and how it ended, as the
// launcher's own line does; a plain value (another program's sigqueue) is not taken for one.
TEST(FailureNotice, CarriesTheRankAndHowItEnded) {
  using shardit::dist::FailureNotice;
  const int killed = SIGKILL;          // a wait status of a process killed by SIGKILL
  const int exited = 3 << 8;           // ... of one that exited with code 3
  for (const FailureNotice& notice : {FailureNotice{1, killed}, FailureNotice{63, exited}, FailureNotice{0, 255 << 8}}) {
    const FailureNotice back = shardit::dist::decode_failure_notice(shardit::dist::encode_failure_notice(notice));
    EXPECT_EQ(back.rank, notice.rank);
    EXPECT_EQ(back.how(), notice.how());
  }
  EXPECT_EQ(FailureNotice({1, killed}).how(), "killed by signal 9 (Killed)");
  EXPECT_EQ(FailureNotice({1, exited}).how(), "exit code 3");
  siginfo_t info{};
  info.si_code = SI_QUEUE;
  info.si_pid = ::getppid();
  info.si_value.sival_int = 7;
  EXPECT_FALSE(shardit::dist::is_failure_notice(&info));
  info.si_value.sival_int = shardit::dist::encode_failure_notice({1, killed});
  EXPECT_TRUE(shardit::dist::is_failure_notice(&info));
  info.si_pid = ::getpid();  // not from the launcher (this process's parent)
  EXPECT_FALSE(shardit::dist::is_failure_notice(&info));
}

}  // namespace
}  // namespace test_launch_env
