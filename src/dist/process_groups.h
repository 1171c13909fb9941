// The communicators of a run, split from the world by a topology-aware layout.
//
// Ranks r = 0..W-1, with node = r / ranks_per_node and local_rank = r % ranks_per_node
// (launchers place consecutive ranks on the same node). With expert-parallel size ep:
//   expert_parallel      ranks r / ep equal: blocks of consecutive ranks, so an EP group
//                        stays inside a node when ep <= ranks_per_node (rank in it: r % ep)
//   expert_data_parallel ranks with the same r % ep: the holders of the same experts
//   data_parallel        all ranks (dense parameters are replicated; each rank reads
//                        different data)
//   intra_node           ranks of the same node (rank in it: local_rank)
//   inter_node           ranks with the same local_rank (rank in it: node)
#pragma once
#include <memory>

#include "dist/communicator.h"

namespace moe::dist {

struct ProcessGroups {
  std::unique_ptr<Communicator> world, data_parallel, expert_parallel, expert_data_parallel, intra_node, inter_node;
  int node = 0;
  int local_rank = 0;
  int n_nodes = 1;
  int ranks_per_node = 1;
};

// Collective over world. ranks_per_node <= 0 means "from the launch environment"
// (LaunchEnv::local_size, which MOE_RANKS_PER_NODE overrides). Throws a one-line error
// when world.size() is not a multiple of ranks_per_node or of expert_parallel_size, or
// when an EP group would straddle nodes unevenly (neither of ep, ranks_per_node divides
// the other).
ProcessGroups make_process_groups(Communicator& world, int expert_parallel_size, int ranks_per_node = 0);

// The world reused as is (a world of one, or tests): all groups are splits of it.
// world is moved into the result's world member.
ProcessGroups make_process_groups(std::unique_ptr<Communicator> world, int expert_parallel_size,
                                  int ranks_per_node = 0);

}  // namespace moe::dist
