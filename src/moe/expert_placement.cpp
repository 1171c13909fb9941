#include "moe/expert_placement.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "moe/token_exchange.h"

namespace moe {

namespace {

// Node-first groups: G groups of consecutive experts, each on a block of ranks.
struct ExpertGroups {
  int64_t count, experts_per_group, ranks_per_group;
};
ExpertGroups checked_groups(int64_t n_experts, int ep_size, int64_t groups) {
  MOE_CHECK(ep_size >= 1 && n_experts % ep_size == 0, "{} experts cannot be split evenly over {} expert-parallel ranks",
            n_experts, ep_size);
  const int64_t G = std::max<int64_t>(groups, 1);
  MOE_CHECK(n_experts % G == 0 && ep_size % G == 0, "{} expert groups do not divide {} experts and {} ranks", G,
            n_experts, ep_size);
  return {G, n_experts / G, ep_size / G};
}

// Group g's experts by falling load (ties: lower id first).
std::vector<int64_t> by_falling_load(const std::vector<int64_t>& load_E, const ExpertGroups& groups, int64_t g) {
  std::vector<int64_t> order(static_cast<size_t>(groups.experts_per_group));
  for (int64_t i = 0; i < groups.experts_per_group; ++i) order[static_cast<size_t>(i)] = g * groups.experts_per_group + i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return load_E[static_cast<size_t>(a)] > load_E[static_cast<size_t>(b)];
  });
  return order;
}

}  // namespace

ExpertPlacement ExpertPlacement::contiguous(int64_t n_experts, int ep_size) {
  MOE_CHECK(ep_size >= 1 && n_experts % ep_size == 0, "{} experts cannot be split evenly over {} expert-parallel ranks",
            n_experts, ep_size);
  std::vector<int> rank_of(static_cast<size_t>(n_experts));
  const int64_t per_rank = n_experts / ep_size;
  for (int64_t e = 0; e < n_experts; ++e) rank_of[static_cast<size_t>(e)] = static_cast<int>(e / per_rank);
  return ExpertPlacement(std::move(rank_of), ep_size);
}

ExpertPlacement ExpertPlacement::balanced(const std::vector<int64_t>& load_E, int ep_size, int64_t groups,
                                          int64_t max_per_rank) {
  const auto n_experts = static_cast<int64_t>(load_E.size());
  const ExpertGroups shape = checked_groups(n_experts, ep_size, groups);
  const int64_t per_rank = max_per_rank > 0 ? max_per_rank : n_experts / ep_size;
  MOE_CHECK(per_rank * shape.ranks_per_group >= shape.experts_per_group,
            "at most {} experts per rank cannot place {} over {} ranks", per_rank, shape.experts_per_group,
            shape.ranks_per_group);
  std::vector<int64_t> rank_load(static_cast<size_t>(ep_size), 0), rank_count(static_cast<size_t>(ep_size), 0);
  std::vector<int> rank_of(static_cast<size_t>(n_experts), 0);
  for (int64_t g = 0; g < shape.count; ++g) {
    const int first_rank = static_cast<int>(g * shape.ranks_per_group);
    const int end_rank = static_cast<int>((g + 1) * shape.ranks_per_group);
    for (int64_t e : by_falling_load(load_E, shape, g)) {
      int best = -1;
      for (int r = first_rank; r < end_rank; ++r)
        if (rank_count[static_cast<size_t>(r)] < per_rank &&
            (best < 0 || rank_load[static_cast<size_t>(r)] < rank_load[static_cast<size_t>(best)]))
          best = r;
      rank_of[static_cast<size_t>(e)] = best;
      rank_load[static_cast<size_t>(best)] += load_E[static_cast<size_t>(e)];
      ++rank_count[static_cast<size_t>(best)];
    }
  }
  return ExpertPlacement(std::move(rank_of), ep_size);
}

std::vector<int64_t> ExpertPlacement::rank_loads(const std::vector<int64_t>& load_E) const {
  MOE_CHECK(static_cast<int64_t>(load_E.size()) == n_experts(), "{} loads for {} experts", load_E.size(), n_experts());
  std::vector<int64_t> loads(static_cast<size_t>(ep_size()), 0);
  for (int64_t e = 0; e < n_experts(); ++e) loads[static_cast<size_t>(rank_of(e))] += load_E[static_cast<size_t>(e)];
  return loads;
}

ExpertPlacement::ExpertPlacement(std::vector<int> rank_of_expert, int ep_size)
    : rank_of_(std::move(rank_of_expert)) {
  MOE_CHECK(ep_size >= 1, "expert-parallel size must be positive, got {}", ep_size);
  experts_of_.resize(static_cast<size_t>(ep_size));
  slot_of_.resize(rank_of_.size());
  for (size_t e = 0; e < rank_of_.size(); ++e) {
    const int rank = rank_of_[e];
    MOE_CHECK(rank >= 0 && rank < ep_size, "expert {} placed on EP rank {}, outside [0, {})", e, rank, ep_size);
    auto& held = experts_of_[static_cast<size_t>(rank)];
    slot_of_[e] = static_cast<int64_t>(held.size());
    held.push_back(static_cast<int64_t>(e));
  }
}

namespace {

// hinged_placement with the hinges chosen: a hinge spans up to `max_span` boundaries (its
// slot shared by up to max_span + 1 ranks). Empty when the others do not fit.
std::vector<std::vector<int64_t>> place_around_hinges(const std::vector<int64_t>& load_E, int ep_size,
                                                      const ExpertGroups& shape, int64_t room, int64_t max_span) {
  const int64_t G = shape.count, ranks_per_group = shape.ranks_per_group;
  auto load = [&](int64_t e) { return static_cast<double>(load_E[static_cast<size_t>(e)]); };
  std::vector<double> rank_load(static_cast<size_t>(ep_size), 0.0);
  std::vector<int64_t> count(static_cast<size_t>(ep_size), 0);
  std::vector<int64_t> hinge(static_cast<size_t>(ep_size), -1);  // the hinge of boundary r (r >= 1)
  std::vector<char> full(static_cast<size_t>(ep_size), 0);        // a rank holding only part of one hinge
  std::vector<std::vector<int64_t>> rest(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) {
    const std::vector<int64_t> order = by_falling_load(load_E, shape, g);
    double group_load = 0;
    for (int64_t e : order) group_load += load(e);
    const double share = group_load / static_cast<double>(ranks_per_group);
    const int64_t first = std::max<int64_t>(1, g * ranks_per_group), end = (g + 1) * ranks_per_group;
    size_t next = 0;
    for (int64_t b = first; b < end;) {
      const int64_t e = order[next++];
      // An expert heavier than two ranks' share spans more boundaries: m + 1 ranks share it.
      int64_t m = 1;
      if (share > 0) m = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(load(e) / share)) - 1);
      m = std::min({m, max_span, end - b});
      for (int64_t r = b - 1; r < b + m; ++r) {
        rank_load[static_cast<size_t>(r)] += load(e) / static_cast<double>(m + 1);
        ++count[static_cast<size_t>(r)];
        if (r >= b && r < b + m - 1) full[static_cast<size_t>(r)] = 1;
      }
      for (int64_t k = b; k < b + m; ++k) hinge[static_cast<size_t>(k)] = e;
      b += m;
    }
    rest[static_cast<size_t>(g)].assign(order.begin() + static_cast<std::ptrdiff_t>(next), order.end());
  }
  std::vector<std::vector<int64_t>> blocks(static_cast<size_t>(ep_size));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t e : rest[static_cast<size_t>(g)]) {
      int64_t best = -1;
      for (int64_t r = g * ranks_per_group; r < (g + 1) * ranks_per_group; ++r)
        if (!full[static_cast<size_t>(r)] && count[static_cast<size_t>(r)] < room &&
            (best < 0 || rank_load[static_cast<size_t>(r)] < rank_load[static_cast<size_t>(best)]))
          best = r;
      if (best < 0) return {};
      rank_load[static_cast<size_t>(best)] += load(e);
      ++count[static_cast<size_t>(best)];
      blocks[static_cast<size_t>(best)].push_back(e);
    }
  for (int r = 0; r < ep_size; ++r) {
    std::vector<int64_t>& block = blocks[static_cast<size_t>(r)];
    std::sort(block.begin(), block.end());
    // A rank's block starts with its boundary's hinge, unless the hinge goes on past it
    // (then the block is empty: the last rank sharing the hinge holds its slot).
    const bool continues = r + 1 < ep_size && hinge[static_cast<size_t>(r) + 1] == hinge[static_cast<size_t>(r)];
    if (r > 0 && !continues) block.insert(block.begin(), hinge[static_cast<size_t>(r)]);
  }
  return blocks;
}

}  // namespace

std::vector<std::vector<int64_t>> hinged_placement(const std::vector<int64_t>& load_E, int ep_size, int64_t groups,
                                                   int64_t max_per_rank) {
  const auto n_experts = static_cast<int64_t>(load_E.size());
  const ExpertGroups shape = checked_groups(n_experts, ep_size, groups);
  const int64_t room = std::max(max_per_rank, n_experts / ep_size + 1);
  // Hinges as wide as the room allows (a middle rank of a wide hinge holds nothing else),
  // down to one per boundary, which always fits: each window then needs at most
  // n_experts / ep_size + 1 slots.
  for (int64_t max_span = shape.ranks_per_group; max_span >= 1; --max_span) {
    std::vector<std::vector<int64_t>> blocks = place_around_hinges(load_E, ep_size, shape, room, max_span);
    if (!blocks.empty()) return blocks;
  }
  MOE_THROW("hinged placement: {} experts do not fit {} per rank", n_experts, room);
}

std::vector<int64_t> split_rank_loads(const std::vector<int64_t>& load_E,
                                      const std::vector<std::vector<int64_t>>& experts_of_rank, bool split) {
  // Loads in slot order: before[s], the load of the slots before s.
  std::vector<int64_t> before = {0}, first_slot = {0};
  for (const auto& experts : experts_of_rank) {
    for (int64_t e : experts) before.push_back(before.back() + load_E[static_cast<size_t>(e)]);
    first_slot.push_back(static_cast<int64_t>(before.size()) - 1);
  }
  const std::vector<int64_t> at = balanced_boundaries(before, first_slot, split);
  std::vector<int64_t> loads(experts_of_rank.size());
  for (size_t p = 0; p < loads.size(); ++p) loads[p] = at[p + 1] - at[p];
  return loads;
}

LayerPlacements rebalance_layers(const std::vector<std::vector<int64_t>>& load_LE,
                                 const std::vector<std::vector<std::vector<int64_t>>>& current, int ep_size,
                                 int64_t groups, int64_t max_per_rank, bool split) {
  MOE_CHECK(load_LE.size() == current.size(), "re-placement: loads of {} layers, placements of {}", load_LE.size(),
            current.size());
  LayerPlacements result;
  for (size_t l = 0; l < load_LE.size(); ++l) {
    const std::vector<int64_t>& load = load_LE[l];
    auto busiest = [&](const std::vector<std::vector<int64_t>>& experts_of_rank) {
      const std::vector<int64_t> loads = split_rank_loads(load, experts_of_rank, split);
      return *std::max_element(loads.begin(), loads.end());
    };
    std::vector<std::vector<int64_t>> then;
    if (split) {
      then = hinged_placement(load, ep_size, groups, max_per_rank);
    } else {
      const ExpertPlacement next = ExpertPlacement::balanced(load, ep_size, groups, max_per_rank);
      for (int p = 0; p < ep_size; ++p) then.push_back(next.experts_of(p));
    }
    const int64_t before = busiest(current[l]), after = busiest(then);
    result.busiest_before += before;
    // Only a better spread is worth the moves (ties keep the experts where they are).
    if (after < before) {
      result.moves = true;
      result.busiest_after += after;
      result.experts_of_rank.push_back(std::move(then));
    } else {
      result.busiest_after += before;
      result.experts_of_rank.push_back(current[l]);
    }
  }
  return result;
}

}  // namespace moe
