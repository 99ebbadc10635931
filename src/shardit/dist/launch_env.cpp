#include "shardit/dist/launch_env.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <vector>

extern char** environ;

namespace shardit::dist {

namespace {

constexpr int kDefaultMasterPort = 29500;

using Vars = std::map<std::string, std::string>;

std::optional<std::string> lookup(const Vars& vars, const std::string& name) {
  const auto it = vars.find(name);
  if (it == vars.end()) return std::nullopt;
  return it->second;
}

// A whole decimal integer (surrounding blanks allowed), or an error naming the variable.
int parse_int(const std::string& name, const std::string& text) {
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(begin, &end, 10);
  bool ok = end != begin && errno == 0 && value >= INT_MIN && value <= INT_MAX;
  if (ok) {
    while (*end == ' ' || *end == '\t' || *end == '\n') ++end;
    ok = *end == '\0';
  }
  TORCH_CHECK(ok, name, "='", text, "' is not an integer; set it to a whole number or unset it");
  return static_cast<int>(value);
}

std::optional<int> optional_int(const Vars& vars, const std::string& name) {
  const auto text = lookup(vars, name);
  if (!text) return std::nullopt;
  return parse_int(name, *text);
}

int required_int(const Vars& vars, const std::string& name, const std::string& launcher,
                 const std::string& because) {
  const auto value = optional_int(vars, name);
  TORCH_CHECK(value.has_value(), name, " is not set, but ", because, " (", launcher,
              " convention); set ", name, " as well, or unset ", because.substr(0, because.find('=')));
  return *value;
}

// The names of the variables a launcher used, for the messages of the range checks.
struct Names {
  std::string rank, world_size, local_rank, local_world_size;
};

// SLURM_TASKS_PER_NODE looks like "2(x3),1": 2 tasks on each of the first 3 nodes, then 1.
int slurm_tasks_on_node(const std::string& text, std::optional<int> node_id) {
  std::vector<int> per_node;
  std::stringstream entries(text);
  std::string entry;
  while (std::getline(entries, entry, ',')) {
    const auto paren = entry.find('(');
    int count = 0;
    int repeat = 1;
    if (paren == std::string::npos) {
      count = parse_int("SLURM_TASKS_PER_NODE", entry);
    } else {
      count = parse_int("SLURM_TASKS_PER_NODE", entry.substr(0, paren));
      const auto close = entry.find(')', paren);
      TORCH_CHECK(close != std::string::npos && entry.compare(paren, 2, "(x") == 0,
                  "SLURM_TASKS_PER_NODE='", text, "' is malformed: expected entries like 2 or 2(x3)");
      repeat = parse_int("SLURM_TASKS_PER_NODE", entry.substr(paren + 2, close - paren - 2));
    }
    TORCH_CHECK(count >= 1 && repeat >= 1, "SLURM_TASKS_PER_NODE='", text,
                "' is malformed: counts must be at least 1");
    for (int i = 0; i < repeat; ++i) per_node.push_back(count);
  }
  TORCH_CHECK(!per_node.empty(), "SLURM_TASKS_PER_NODE is empty");
  if (node_id) {
    TORCH_CHECK(*node_id >= 0 && *node_id < static_cast<int>(per_node.size()), "SLURM_NODEID=",
                *node_id, " is out of range for SLURM_TASKS_PER_NODE='", text, "' (",
                per_node.size(), " nodes)");
    return per_node[*node_id];
  }
  for (int count : per_node) {
    TORCH_CHECK(count == per_node[0], "SLURM_TASKS_PER_NODE='", text,
                "' differs between nodes and SLURM_NODEID is not set; set SLURM_NTASKS_PER_NODE");
  }
  return per_node[0];
}

void validate(const LaunchEnv& env, const Names& names) {
  TORCH_CHECK(env.world_size >= 1, names.world_size, "=", env.world_size,
              " is invalid: the world needs at least 1 rank");
  TORCH_CHECK(env.rank >= 0, names.rank, "=", env.rank, " is negative: ranks count from 0");
  TORCH_CHECK(env.rank < env.world_size, names.rank, "=", env.rank, " is out of range for ",
              names.world_size, "=", env.world_size, " (expected 0..", env.world_size - 1, ")");
  TORCH_CHECK(env.local_world_size >= 1, names.local_world_size, "=", env.local_world_size,
              " is invalid: a node runs at least 1 rank");
  TORCH_CHECK(env.local_world_size <= env.world_size, names.local_world_size, "=",
              env.local_world_size, " is larger than ", names.world_size, "=", env.world_size);
  TORCH_CHECK(env.local_rank >= 0, names.local_rank, "=", env.local_rank,
              " is negative: local ranks count from 0");
  TORCH_CHECK(env.local_rank < env.local_world_size, names.local_rank, "=", env.local_rank,
              " is out of range for ", names.local_world_size, "=", env.local_world_size,
              " (expected 0..", env.local_world_size - 1, ")");
}

// MASTER_ADDR / MASTER_PORT, shared by every launcher. `port_required`: torchrun always sets the
// port, so a missing one means a broken environment rather than a default.
void read_master(const Vars& vars, LaunchEnv& env, bool port_required) {
  if (const auto addr = lookup(vars, "MASTER_ADDR")) env.master_addr = *addr;
  const auto port = optional_int(vars, "MASTER_PORT");
  if (port) {
    TORCH_CHECK(*port >= 1 && *port <= 65535, "MASTER_PORT=", *port,
                " is out of range (expected 1..65535)");
    env.master_port = *port;
  }
  if (env.world_size == 1) return;
  if (!port) {
    TORCH_CHECK(!port_required, "MASTER_PORT is not set but WORLD_SIZE=", env.world_size,
                ": the ranks need a rendezvous port; set MASTER_PORT (torchrun sets it)");
    env.master_port = kDefaultMasterPort;
  }
  if (env.master_addr.empty()) {
    TORCH_CHECK(env.local_world_size == env.world_size, "MASTER_ADDR is not set but the ",
                env.world_size, " ranks span several nodes (", env.local_world_size,
                " on this one); set MASTER_ADDR to the host of rank 0");
  }
}

}  // namespace

const char* launch_source_name(LaunchSource source) {
  switch (source) {
    case LaunchSource::Single: return "single";
    case LaunchSource::Torchrun: return "torchrun";
    case LaunchSource::OpenMPI: return "openmpi";
    case LaunchSource::PMI: return "pmi";
    case LaunchSource::Slurm: return "slurm";
  }
  return "unknown";
}

LaunchEnv LaunchEnv::from_variables(const Vars& vars) {
  LaunchEnv env;
  Names names;
  if (lookup(vars, "RANK") || lookup(vars, "WORLD_SIZE")) {
    env.source = LaunchSource::Torchrun;
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  } else if (lookup(vars, "OMPI_COMM_WORLD_RANK") || lookup(vars, "OMPI_COMM_WORLD_SIZE")) {
    env.source = LaunchSource::OpenMPI;
    names = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"};
  } else if (lookup(vars, "PMI_RANK") || lookup(vars, "PMI_SIZE")) {
    env.source = LaunchSource::PMI;
    names = {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};
  } else if (lookup(vars, "SLURM_PROCID") && lookup(vars, "SLURM_NTASKS")) {
    env.source = LaunchSource::Slurm;
    names = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"};
  } else {
    return env;  // no launcher: rank 0 of 1
  }

  const std::string launcher = launch_source_name(env.source);
  env.world_size = required_int(vars, names.world_size, launcher,
                                names.rank + "=" + lookup(vars, names.rank).value_or("") + " is set");
  env.rank = required_int(vars, names.rank, launcher,
                          names.world_size + "=" + std::to_string(env.world_size) + " is set");
  // Without the local variables, assume every rank runs on this node.
  env.local_rank = optional_int(vars, names.local_rank).value_or(env.rank);
  if (env.source == LaunchSource::Slurm && !lookup(vars, "SLURM_NTASKS_PER_NODE") &&
      lookup(vars, "SLURM_TASKS_PER_NODE")) {
    names.local_world_size = "SLURM_TASKS_PER_NODE";
    env.local_world_size = slurm_tasks_on_node(*lookup(vars, "SLURM_TASKS_PER_NODE"),
                                               optional_int(vars, "SLURM_NODEID"));
  } else {
    env.local_world_size = optional_int(vars, names.local_world_size).value_or(env.world_size);
  }
  validate(env, names);
  read_master(vars, env, /*port_required=*/env.source == LaunchSource::Torchrun);
  return env;
}

LaunchEnv LaunchEnv::from_environment() {
  Vars vars;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string text = *entry;
    const auto eq = text.find('=');
    if (eq == std::string::npos) continue;
    vars.emplace(text.substr(0, eq), text.substr(eq + 1));
  }
  return from_variables(vars);
}

}  // namespace shardit::dist
