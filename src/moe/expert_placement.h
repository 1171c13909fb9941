// Which EP rank computes which expert: ExpertPlacement (whole experts, data that may change
// between steps), the split-expert ("hinge") placements and the per-layer re-placement by
// load, for the CPU and the GPU path alike. Pure functions of loads and sizes: every rank
// given the same loads computes the same placement. One layer's result as slots:
// moe/expert_slots.h; the cuts of one micro-batch's exchange: moe/token_exchange.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe {

class ExpertPlacement {
 public:
  // Expert e on EP rank e / (n_experts / ep_size): contiguous blocks.
  static ExpertPlacement contiguous(int64_t n_experts, int ep_size);
  // Experts spread so the ranks' summed loads are as even as a greedy pass makes them:
  // experts by falling load (ties: lower id first), each to the least loaded rank with
  // room (ties: lower rank). Room: max_per_rank experts, 0 meaning n_experts / ep_size
  // (every rank the same count); more lets a rank holding a hot expert take fewer others
  // (with one expert taking half the load, only unequal counts balance 2 ranks).
  // Deterministic, so every rank given the same loads computes the same placement.
  // groups > 1 (dividing both counts): expert group g (consecutive experts,
  // moe.route_groups) stays on rank block g, e.g. its node, so node-first routing still
  // limits the nodes a token reaches.
  static ExpertPlacement balanced(const std::vector<int64_t>& load_E, int ep_size, int64_t groups = 1,
                                  int64_t max_per_rank = 0);
  // The summed load of each rank's experts.
  std::vector<int64_t> rank_loads(const std::vector<int64_t>& load_E) const;
  // rank_of_expert[e]: the EP rank holding expert e. Slots follow expert order on each rank.
  ExpertPlacement(std::vector<int> rank_of_expert, int ep_size);

  int64_t n_experts() const { return static_cast<int64_t>(rank_of_.size()); }
  int ep_size() const { return static_cast<int>(experts_of_.size()); }
  int rank_of(int64_t expert) const { return rank_of_[static_cast<size_t>(expert)]; }
  int64_t slot_of(int64_t expert) const { return slot_of_[static_cast<size_t>(expert)]; }
  const std::vector<int64_t>& experts_of(int ep_rank) const { return experts_of_[static_cast<size_t>(ep_rank)]; }
  bool operator==(const ExpertPlacement& o) const { return rank_of_ == o.rank_of_ && ep_size() == o.ep_size(); }

 private:
  std::vector<int> rank_of_;
  std::vector<int64_t> slot_of_;
  std::vector<std::vector<int64_t>> experts_of_;
};

// Split experts (moe/token_exchange.h): blocks of experts per EP rank in which the
// first expert of every block but the first is a hinge, also computed by the rank before,
// the boundary between the two moving inside it with each micro-batch's load. The
// hinges are the heaviest experts (of the group whose block they start, with `groups`);
// one heavier than two ranks' share spans more boundaries (the blocks between empty: m
// boundaries in one slot, m + 1 ranks sharing it). Each hinge counts its share on every
// rank holding it, then the other experts go greedily (falling load) to the least loaded
// rank of their group with room (at most max_per_rank experts in a rank's window, block
// and next hinge; at least n_experts / ep_size + 1); hinges only as wide as leaves room
// for the others (one per boundary always does).
std::vector<std::vector<int64_t>> hinged_placement(const std::vector<int64_t>& load_E, int ep_size, int64_t groups,
                                                   int64_t max_per_rank);
// Each rank's load under blocks of experts (experts_of_rank), with split experts when
// `split`: each boundary moved inside its hinge to where the load reaches its share,
// as far as the hinge allows (the device's boundary_cuts on whole loads).
std::vector<int64_t> split_rank_loads(const std::vector<int64_t>& load_E,
                                      const std::vector<std::vector<int64_t>>& experts_of_rank, bool split);

// Per-layer re-placement (dynamic load balancing, CPU and GPU: each MoE layer has its own
// slots): for every layer, the balanced placement of its load since the last placement
// (ExpertPlacement::balanced with `groups` and `max_per_rank`, or hinged_placement with
// `split`) where that lowers the busiest rank's load, else the layer's current placement
// (experts of each rank).
struct LayerPlacements {
  std::vector<std::vector<std::vector<int64_t>>> experts_of_rank;  // per layer, per rank
  bool moves = false;                    // some layer's placement changed
  int64_t busiest_before = 0, busiest_after = 0;  // the busiest rank's load, summed over the layers
};
LayerPlacements rebalance_layers(const std::vector<std::vector<int64_t>>& load_LE,
                                 const std::vector<std::vector<std::vector<int64_t>>>& current, int ep_size,
                                 int64_t groups, int64_t max_per_rank, bool split = false);

}  // namespace moe
