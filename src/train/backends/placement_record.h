// The checkpoint's expert_placement record (docs/CHECKPOINTS.md): what a resumed
// expert-parallel run needs to continue its placement bit for bit (each MoE layer's experts
// per EP rank, the loads and steps the next re-placement weighs) and the a2a compression
// switch's state; and the schedule of re-placement by load that it records. One owner for
// the CPU ranks and the GPU backend.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/parallel_config.h"
#include "moe/expert_placement.h"

namespace moe {

struct PlacementRecord {
  std::string a2a_compression;  // A2aCompressionSwitch::save()'s JSON; empty: none
  bool has_placement = false;   // the fields below were saved (re-placement by load was on)
  int64_t ep_size = 0;
  std::vector<std::vector<std::vector<int64_t>>> experts_of_rank;  // [layer][EP rank] -> experts
  int64_t steps_since_placement = 0;
  std::vector<std::vector<int64_t>> load_since_placement;

  // JSON text; empty when there is nothing to save.
  std::string dump() const;
  // Of dump()'s text (empty: an empty record). Refuses text that is not a JSON object.
  static PlacementRecord parse(const std::string& text);
};

// Dynamic load balancing (parallel.rebalance_interval): each MoE layer's global loads (summed
// over the ranks, so every rank decides alike) added up step by step; every interval steps
// the balanced placement of those loads (rebalance_layers: up to rebalance_max_experts per
// rank; with node-first routing over groups that map onto blocks of EP ranks, experts stay
// in their group's block, so a token still reaches only route_top_groups of them).
class PlacementSchedule {
 public:
  // After a step: its loads [layer][expert] and each layer's current experts per EP rank.
  // The new placement when the interval is reached and some layer moves; the loads restart.
  std::optional<LayerPlacements> step(const std::vector<std::vector<int64_t>>& load_LE,
                                      const std::vector<std::vector<std::vector<int64_t>>>& current, int ep_size,
                                      const ParallelConfig& parallel, int64_t route_groups);
  // The schedule's part of the record (has_placement and the experts are the caller's).
  void save(PlacementRecord& record) const;
  void restore(const PlacementRecord& record);

 private:
  std::vector<std::vector<int64_t>> load_since_placement_;
  int64_t steps_since_placement_ = 0;
};

}  // namespace moe
