#pragma once
// How a rank learns who it is, from the environment of the common launchers.
#include <map>
#include <string>

namespace shardit::dist {

/// The launcher whose conventions the environment followed.
enum class LaunchSource { Single, Torchrun, OpenMPI, PMI, Slurm };
const char* launch_source_name(LaunchSource source);

/// A rank's identity and rendezvous point.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  ///< empty: this host, rank 0's store binds to loopback
  int master_port = 0;      ///< 0 only when world_size == 1
  LaunchSource source = LaunchSource::Single;

  /// Reads torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
  /// OpenMPI (OMPI_COMM_WORLD_*), MPICH/PMI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID...) and Slurm
  /// (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, with MASTER_ADDR/PORT), in
  /// that order of precedence. None of them: rank 0 of 1. Bad values (WORLD_SIZE=0, RANK >=
  /// WORLD_SIZE, a non-numeric port) throw naming the variable.
  static LaunchEnv from_environment();
  /// The same rules over an explicit variable map (for tests).
  static LaunchEnv from_variables(const std::map<std::string, std::string>& vars);
};

}  // namespace shardit::dist
