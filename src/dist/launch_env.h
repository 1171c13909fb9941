// Who this process is in a multi-process run, read from the launcher's environment:
// mpirun (OMPI_COMM_WORLD_*), Slurm srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...)
// or torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, ..., which `moe launch` sets).
// None of them: a world of one.
#pragma once
#include <functional>
#include <map>
#include <string>

namespace moe::dist {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;  // ranks on this node
  int device_rank = 0;  // the launcher's own local rank: picks the GPU, even when nodes are simulated
  int node_rank = 0;
  int n_nodes = 1;
  std::string master_addr;  // torchrun-style rendezvous (empty when not given)
  int master_port = 0;
  // Where rank 0 listens for moe's own rendezvous (src/dist/rendezvous.h) on master_addr:
  // MOE_RENDEZVOUS_PORT when set; under torchrun (TORCHELASTIC_RUN_ID set), whose agent's
  // store already listens on MASTER_PORT, MASTER_PORT + 1 (65534 for 65535); else MASTER_PORT.
  int rendezvous_port = 0;
  bool torchelastic = false;  // started by torchrun (its elastic agent)
  std::string source = "none";  // "mpirun", "slurm", "torchrun" or "none"
  bool nodes_simulated = false;  // MOE_RANKS_PER_NODE split the ranks into nodes
};

// Reads the variables through getenv. Throws moe::ConfigError with one line naming the
// variable when values are missing, not numbers, or inconsistent (rank >= world size, ...).
// MOE_RANKS_PER_NODE=K (tests): pretend nodes of K consecutive ranks, i.e. local_rank =
// rank % K, node_rank = rank / K, local_size = K, n_nodes = world_size / K.
LaunchEnv read_launch_env();
// Same, with a lookup function (tests): returns nullptr for unset variables.
LaunchEnv parse_launch_env(const std::function<const char*(const char*)>& getenv_fn);
LaunchEnv parse_launch_env(const std::map<std::string, std::string>& env);

std::string describe(const LaunchEnv& env);

}  // namespace moe::dist
