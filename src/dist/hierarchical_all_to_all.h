// All-to-all with per-peer counts over an expert-parallel group, in two implementations
// with the same results bit for bit:
//   flat          one Communicator::all_to_all_v over the EP group.
//   hierarchical  for an EP group spanning nodes: (1) inside each node, every rank hands
//                 each local peer the tokens bound for that peer's counterparts (same local
//                 index) on all nodes; (2) across nodes, among ranks with the same local
//                 index, each rank sends one block per destination node. So every element
//                 crosses the inter-node link once, to its destination node only, and the
//                 number of inter-node messages per rank is n_nodes - 1 instead of
//                 (n_nodes - 1) * ranks_per_node.
// Both keep Communicator::all_to_all_v's contract: send and recv packed by EP peer,
// send_counts[p] of rank r == recv_counts[r] of rank p, counts in elements.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/process_groups.h"
#include "config/parallel_config.h"

namespace moe::dist {

class AllToAll {
 public:
  virtual ~AllToAll() = default;
  // "flat" or "hierarchical".
  virtual std::string name() const = 0;
  virtual Communicator& group() = 0;
  // Device backends: the caller's CUDA stream for every communicator this exchange uses
  // (Communicator::set_stream).
  virtual void set_stream(void* stream) = 0;
  // Same contract as Communicator::all_to_all_v over group().
  virtual void exchange(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                        const std::vector<int64_t>& recv_counts, DType dtype) = 0;
  // Non-blocking form. flat: the backend's all_to_all_v_async. hierarchical: the stages
  // run one after another, so the result is already complete when this returns (the
  // returned Work is done).
  virtual std::unique_ptr<Work> exchange_async(const void* send, const std::vector<int64_t>& send_counts,
                                               void* recv, const std::vector<int64_t>& recv_counts,
                                               DType dtype) = 0;
};

// ep_group must outlive the result; node is this rank's
// node (ProcessGroups::node). Collective over ep_group (hierarchical splits it into its
// intra-node and inter-node parts; it needs the same number of EP ranks on every node it
// spans, consecutive in the group). An EP group inside one node makes hierarchical
// behave as flat.
std::unique_ptr<AllToAll> make_all_to_all(AllToAllKind kind, Communicator& ep_group, int node);
// Same, taking the node from groups (ep_group is usually *groups.expert_parallel).
std::unique_ptr<AllToAll> make_all_to_all(AllToAllKind kind, Communicator& ep_group,
                                          const ProcessGroups& groups);

// One hierarchical exchange with throwaway sub-groups (tests; a trainer keeps the AllToAll).
void all_to_all_v_hierarchical(ProcessGroups& groups, Communicator& ep_group, const void* send,
                               const std::vector<int64_t>& send_counts, void* recv,
                               const std::vector<int64_t>& recv_counts, DType dtype);

}  // namespace moe::dist
