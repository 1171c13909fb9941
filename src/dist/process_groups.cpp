#include "dist/process_groups.h"

#include "core/error.h"
#include "dist/launch_env.h"

namespace moe::dist {

ProcessGroups make_process_groups(Communicator& world, int expert_parallel_size, int ranks_per_node) {
  const int world_size = world.size(), rank = world.rank();
  if (ranks_per_node <= 0) {
    const LaunchEnv env = read_launch_env();
    // The launch environment describes the launch's world; a different world (a world of
    // one, a test's sub-communicator) is one node.
    ranks_per_node = env.world_size == world_size ? env.local_size : world_size;
  }
  const int ep = expert_parallel_size;
  if (ep < 1) MOE_CONFIG_ERROR("expert-parallel size {} must be at least 1", ep);
  if (world_size % ep != 0)
    MOE_CONFIG_ERROR("world size {} is not a multiple of the expert-parallel size {}", world_size, ep);
  if (ranks_per_node > world_size || world_size % ranks_per_node != 0)
    MOE_CONFIG_ERROR("world size {} is not a multiple of {} ranks per node", world_size, ranks_per_node);
  if (ranks_per_node % ep != 0 && ep % ranks_per_node != 0)
    MOE_CONFIG_ERROR(
        "expert-parallel size {} and {} ranks per node: one must divide the other (so that EP groups fill whole nodes "
        "or fit inside one)",
        ep, ranks_per_node);

  ProcessGroups groups;
  groups.ranks_per_node = ranks_per_node;
  groups.n_nodes = world_size / ranks_per_node;
  groups.node = rank / ranks_per_node;
  groups.local_rank = rank % ranks_per_node;
  // Every split below is collective over world, in the same order on every rank.
  groups.world = world.split(0, rank);
  groups.data_parallel = world.split(0, rank);
  groups.expert_parallel = world.split(rank / ep, rank);
  groups.expert_data_parallel = world.split(rank % ep, rank);
  groups.intra_node = world.split(groups.node, rank);
  groups.inter_node = world.split(groups.local_rank, rank);
  return groups;
}

ProcessGroups make_process_groups(std::unique_ptr<Communicator> world, int expert_parallel_size, int ranks_per_node) {
  MOE_CHECK(world != nullptr, "make_process_groups needs a world communicator");
  ProcessGroups groups = make_process_groups(*world, expert_parallel_size, ranks_per_node);
  groups.world = std::move(world);
  return groups;
}

}  // namespace moe::dist
