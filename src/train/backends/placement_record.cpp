#include "train/backends/placement_record.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moe {

std::string PlacementRecord::dump() const {
  nlohmann::json state = nlohmann::json::object();
  if (!a2a_compression.empty()) state["a2a_compression"] = nlohmann::json::parse(a2a_compression);
  if (has_placement) {
    state["ep_size"] = ep_size;
    state["experts_of_rank"] = experts_of_rank;
    state["steps_since_placement"] = steps_since_placement;
    state["load_since_placement"] = load_since_placement;
  }
  return state.empty() ? std::string{} : state.dump();
}

PlacementRecord PlacementRecord::parse(const std::string& text) {
  PlacementRecord record;
  if (text.empty()) return record;
  const nlohmann::json state = nlohmann::json::parse(text, nullptr, false);
  MOE_CHECK(!state.is_discarded() && state.is_object(), "checkpoint: expert_placement is not JSON");
  if (state.contains("a2a_compression")) record.a2a_compression = state["a2a_compression"].dump();
  record.has_placement = state.contains("experts_of_rank");
  record.ep_size = state.value("ep_size", int64_t{0});
  record.experts_of_rank = state.value("experts_of_rank", std::vector<std::vector<std::vector<int64_t>>>{});
  record.steps_since_placement = state.value("steps_since_placement", int64_t{0});
  record.load_since_placement = state.value("load_since_placement", std::vector<std::vector<int64_t>>{});
  return record;
}

std::optional<LayerPlacements> PlacementSchedule::step(const std::vector<std::vector<int64_t>>& load_LE,
                                                       const std::vector<std::vector<std::vector<int64_t>>>& current,
                                                       int ep_size, const ParallelConfig& parallel,
                                                       int64_t route_groups) {
  if (load_since_placement_.size() != load_LE.size()) {
    load_since_placement_.assign(load_LE.size(), {});
    for (size_t l = 0; l < load_LE.size(); ++l) load_since_placement_[l].assign(load_LE[l].size(), 0);
  }
  for (size_t l = 0; l < load_LE.size(); ++l) {
    MOE_CHECK(load_LE[l].size() == load_since_placement_[l].size(), "expert re-placement: {} loads for {} experts",
              load_LE[l].size(), load_since_placement_[l].size());
    for (size_t e = 0; e < load_LE[l].size(); ++e) load_since_placement_[l][e] += load_LE[l][e];
  }
  if (++steps_since_placement_ < parallel.rebalance_interval) return std::nullopt;
  const bool grouped = route_groups > 1 && ep_size % route_groups == 0;
  LayerPlacements next = rebalance_layers(load_since_placement_, current, ep_size, grouped ? route_groups : 1,
                                          parallel.rebalance_max_experts, parallel.split_experts);
  for (auto& layer : load_since_placement_) std::fill(layer.begin(), layer.end(), 0);
  steps_since_placement_ = 0;
  if (!next.moves) return std::nullopt;
  return next;
}

void PlacementSchedule::save(PlacementRecord& record) const {
  record.steps_since_placement = steps_since_placement_;
  record.load_since_placement = load_since_placement_;
}

void PlacementSchedule::restore(const PlacementRecord& record) {
  steps_since_placement_ = record.steps_since_placement;
  load_since_placement_ = record.load_since_placement;
}

}  // namespace moe
