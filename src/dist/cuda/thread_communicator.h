// N threads of one process, one GPU, as N ranks of a device-memory communicator: the
// multi-GPU paths (data and expert parallelism, ZeRO-1, split experts, re-placement,
// checkpoint gathers) run whole on a single GPU, e.g. in tests, with several trainers
// in several threads. The same semantics as the nccl backend, more strictly ordered:
// each collective waits on the host for the caller's stream, for every rank to arrive,
// and for its own result (so nothing overlaps, and every rank must issue the same
// collectives in the same order across all its communicators, as its threads do when
// they run the same program). Sums add the ranks in rank order, the same bits on every
// rank.
#pragma once
#include <memory>
#include <vector>

#include "dist/communicator.h"

namespace moe::dist {

// The world of n ranks: element r is rank r's communicator, to be used by one thread.
// ranks_per_node > 0 (dividing n) simulates nodes of that many consecutive ranks (e.g.
// for the hierarchical all-to-all); 0: one node.
std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int n, int ranks_per_node = 0);

}  // namespace moe::dist
