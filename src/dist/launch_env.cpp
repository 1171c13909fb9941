#include "dist/launch_env.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>

#include "core/error.h"

namespace moe::dist {
namespace {

using Getenv = std::function<const char*(const char*)>;

// The integer in variable `name`, or fallback when unset; a ConfigError when not a number.
int env_int(const Getenv& getenv_fn, const char* name, int fallback, bool required = false) {
  const char* text = getenv_fn(name);
  if (text == nullptr || *text == '\0') {
    if (required) MOE_CONFIG_ERROR("launch environment: {} is not set", name);
    return fallback;
  }
  int value = 0;
  const char* end = text + std::char_traits<char>::length(text);
  auto [ptr, ec] = std::from_chars(text, end, value);
  if (ec != std::errc() || ptr != end) MOE_CONFIG_ERROR("launch environment: {}='{}' is not an integer", name, text);
  return value;
}

std::string env_string(const Getenv& getenv_fn, const char* name) {
  const char* text = getenv_fn(name);
  return text == nullptr ? std::string() : std::string(text);
}

bool is_set(const Getenv& getenv_fn, const char* name) {
  const char* text = getenv_fn(name);
  return text != nullptr && *text != '\0';
}

void validate(const LaunchEnv& env) {
  const std::string from = env.source;
  if (env.world_size < 1) MOE_CONFIG_ERROR("launch environment ({}): world size {} is not positive", from, env.world_size);
  if (env.rank < 0 || env.rank >= env.world_size)
    MOE_CONFIG_ERROR("launch environment ({}): rank {} outside world size {}", from, env.rank, env.world_size);
  if (env.local_size < 1 || env.local_size > env.world_size)
    MOE_CONFIG_ERROR("launch environment ({}): local size {} outside 1..{}", from, env.local_size, env.world_size);
  if (env.local_rank < 0 || env.local_rank >= env.local_size)
    MOE_CONFIG_ERROR("launch environment ({}): local rank {} outside local size {}", from, env.local_rank,
                     env.local_size);
  if (env.n_nodes < 1 || env.node_rank < 0 || env.node_rank >= env.n_nodes)
    MOE_CONFIG_ERROR("launch environment ({}): node {} outside {} nodes", from, env.node_rank, env.n_nodes);
  if (env.master_port < 0 || env.master_port > 65535)
    MOE_CONFIG_ERROR("launch environment ({}): MASTER_PORT {} outside 0..65535", from, env.master_port);
}

}  // namespace

LaunchEnv parse_launch_env(const Getenv& getenv_fn) {
  LaunchEnv env;
  if (is_set(getenv_fn, "OMPI_COMM_WORLD_SIZE")) {
    env.source = "mpirun";
    env.world_size = env_int(getenv_fn, "OMPI_COMM_WORLD_SIZE", 1, true);
    env.rank = env_int(getenv_fn, "OMPI_COMM_WORLD_RANK", 0, true);
    env.local_rank = env_int(getenv_fn, "OMPI_COMM_WORLD_LOCAL_RANK", 0, true);
    env.local_size = env_int(getenv_fn, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, true);
    // OpenMPI has no node index variable; mpirun's default mapping (--map-by slot) puts
    // consecutive ranks on a node in equal numbers, which validate() checks below.
    env.node_rank = env.rank / std::max(env.local_size, 1);
    env.n_nodes = env.world_size / std::max(env.local_size, 1);
  } else if (is_set(getenv_fn, "SLURM_PROCID") && !is_set(getenv_fn, "RANK")) {
    env.source = "slurm";
    env.rank = env_int(getenv_fn, "SLURM_PROCID", 0, true);
    env.world_size = env_int(getenv_fn, "SLURM_NTASKS", 1, true);
    env.local_rank = env_int(getenv_fn, "SLURM_LOCALID", 0, true);
    env.node_rank = env_int(getenv_fn, "SLURM_NODEID", 0, true);
    env.n_nodes = env_int(getenv_fn, "SLURM_NNODES", env_int(getenv_fn, "SLURM_JOB_NUM_NODES", 1));
    if (env.n_nodes < 1 || env.world_size % env.n_nodes != 0)
      MOE_CONFIG_ERROR("launch environment (slurm): SLURM_NTASKS={} is not a multiple of SLURM_NNODES={} (give every "
                       "node the same number of tasks)",
                       env.world_size, env.n_nodes);
    env.local_size = env.world_size / env.n_nodes;
  } else if (is_set(getenv_fn, "RANK") || is_set(getenv_fn, "WORLD_SIZE")) {
    env.source = "torchrun";
    env.rank = env_int(getenv_fn, "RANK", 0, true);
    env.world_size = env_int(getenv_fn, "WORLD_SIZE", 1, true);
    env.local_rank = env_int(getenv_fn, "LOCAL_RANK", env.rank);
    env.local_size = env_int(getenv_fn, "LOCAL_WORLD_SIZE", env.world_size);
    env.node_rank = env_int(getenv_fn, "GROUP_RANK", env_int(getenv_fn, "NODE_RANK", env.rank / std::max(env.local_size, 1)));
    env.n_nodes = env.world_size / std::max(env.local_size, 1);
  }
  env.master_addr = env_string(getenv_fn, "MASTER_ADDR");
  env.master_port = env_int(getenv_fn, "MASTER_PORT", 0);
  validate(env);
  // torchrun's agent serves its TCPStore on MASTER_PORT for as long as the workers run, so
  // rank 0 cannot listen there: our rendezvous takes the next port unless told another.
  env.torchelastic = env.source == "torchrun" && is_set(getenv_fn, "TORCHELASTIC_RUN_ID");
  env.rendezvous_port = env.master_port;
  if (env.torchelastic && env.master_port > 0) env.rendezvous_port = env.master_port < 65535 ? env.master_port + 1 : 65534;
  if (is_set(getenv_fn, "MOE_RENDEZVOUS_PORT")) {
    env.rendezvous_port = env_int(getenv_fn, "MOE_RENDEZVOUS_PORT", 0);
    if (env.rendezvous_port < 1 || env.rendezvous_port > 65535)
      MOE_CONFIG_ERROR("launch environment: MOE_RENDEZVOUS_PORT {} outside 1..65535", env.rendezvous_port);
  }
  if (env.world_size % env.local_size != 0)
    MOE_CONFIG_ERROR("launch environment ({}): world size {} is not a multiple of the {} ranks per node", env.source,
                     env.world_size, env.local_size);
  if (env.source != "none" && env.node_rank * env.local_size + env.local_rank != env.rank)
    MOE_CONFIG_ERROR(
        "launch environment ({}): rank {} is not node {} x {} ranks per node + local rank {} (place consecutive ranks "
        "on the same node, e.g. mpirun --map-by slot)",
        env.source, env.rank, env.node_rank, env.local_size, env.local_rank);

  env.device_rank = env.local_rank;
  const int simulated = env_int(getenv_fn, "MOE_RANKS_PER_NODE", 0);
  if (simulated != 0) {
    if (simulated < 0 || env.world_size % simulated != 0)
      MOE_CONFIG_ERROR("MOE_RANKS_PER_NODE={} does not divide the world size {}", simulated, env.world_size);
    env.local_size = simulated;
    env.local_rank = env.rank % simulated;
    env.node_rank = env.rank / simulated;
    env.n_nodes = env.world_size / simulated;
    env.nodes_simulated = true;
  }
  return env;
}

LaunchEnv parse_launch_env(const std::map<std::string, std::string>& vars) {
  return parse_launch_env([&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

LaunchEnv read_launch_env() {
  return parse_launch_env([](const char* name) -> const char* { return std::getenv(name); });
}

std::string describe(const LaunchEnv& env) {
  return fmt::format("rank {}/{} (node {}/{}{}, local rank {}/{}) from {}", env.rank, env.world_size, env.node_rank,
                     env.n_nodes, env.nodes_simulated ? " simulated" : "", env.local_rank, env.local_size, env.source);
}

}  // namespace moe::dist
