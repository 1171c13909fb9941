// The ranges an expert-parallel rank's gradients and optimizer cover, and per-slot values
// in expert order, from a layout with a re-placed, split layer and an equal one.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "model/expert_layout.h"

namespace moe {
namespace {

// Layer 0: experts {2, 0} on rank 0 and {1, 3} on rank 1, split (rank 0's window also
// takes slot 2, expert 1); tensors of 10 elements per expert at 100, 200, 300.
// Layer 1: equal blocks, not split; tensors at 400, 500, 600.
ExpertLayout two_layers() {
  return {{expert_slots_from_blocks({{2, 0}, {1, 3}}, /*split=*/true), {{100, 40}, {200, 40}, {300, 40}}},
          {equal_expert_slots(4, 2, /*split=*/false), {{400, 40}, {500, 40}, {600, 40}}}};
}

TEST(ExpertLayout, OwnRangesAreEachRanksWindowInEveryExpertTensor) {
  const ExpertLayout layout = two_layers();
  EXPECT_EQ(own_expert_ranges(layout, 0),
            (RangeList{{100, 30}, {200, 30}, {300, 30}, {400, 20}, {500, 20}, {600, 20}}));
  EXPECT_EQ(own_expert_ranges(layout, 1),
            (RangeList{{120, 20}, {220, 20}, {320, 20}, {420, 20}, {520, 20}, {620, 20}}));
}

TEST(ExpertLayout, ARankKeepsMemoryForAllButTheOtherRanksExperts) {
  const ExpertLayout layout = two_layers();
  // Rank 1 holds slots 2-3 of layer 0 (from 120, 220, 320) and of layer 1.
  EXPECT_EQ(resident_ranges(layout, 1, 700),
            (RangeList{{0, 100}, {120, 80}, {220, 80}, {320, 80}, {420, 80}, {520, 80}, {620, 80}}));
  // Rank 0's window ends inside each tensor: layer 0 slots 0-2, layer 1 slots 0-1.
  EXPECT_EQ(resident_ranges(layout, 0, 700),
            (RangeList{{0, 130}, {140, 90}, {240, 90}, {340, 80}, {440, 80}, {540, 80}, {640, 60}}));
}

TEST(ExpertLayout, HingesAreTheSlotsTwoRanksHold) {
  const ExpertLayout layout = two_layers();
  EXPECT_EQ(hinge_ranges(layout), (RangeList{{120, 10}, {220, 10}, {320, 10}}));
  // Slot 2 holds expert 1; the equal layer has no hinge.
  EXPECT_EQ(hinge_flags(layout), (std::vector<char>{0, 1, 0, 0, 0, 0, 0, 0}));
  EXPECT_TRUE(hinge_ranges({layout[1]}).empty());
}

TEST(ExpertLayout, PerSlotValuesGoToTheirExperts) {
  const ExpertLayout layout = two_layers();
  EXPECT_EQ(to_expert_order(layout, {10, 11, 12, 13, 20, 21, 22, 23}),
            (std::vector<double>{11, 12, 10, 13, 20, 21, 22, 23}));
  EXPECT_THROW(to_expert_order(layout, {1, 2, 3}), Error);
  EXPECT_THROW(to_expert_order(layout, std::vector<double>(9)), Error);
}

}  // namespace
}  // namespace moe
