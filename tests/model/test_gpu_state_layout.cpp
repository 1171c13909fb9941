// GpuParameterStore's ZeRO layout as host code (model/gpu_state_layout.h): the packed
// optimizer state's offsets and which ranges keep memory of their own when a block is
// shared by stages.
#include "model/gpu_state_layout.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace moe {
namespace {

TEST(GpuStateLayout, PackedRangesKeepTheirOffsetModuloSixteen) {
  // [16, +10) at 0; [40, +30) at the next multiple of 16 (16) plus 40 % 16 = 8: 24;
  // [100, +3) at 64 + 4 = 68 (after 54, 64 is the next multiple); 71 rounds to 80.
  const PackedState packed = packed_state_layout({{16, 10}, {40, 30}, {100, 3}});
  EXPECT_EQ(packed.at, (std::vector<int64_t>{0, 24, 68}));
  EXPECT_EQ(packed.total, 80);
  EXPECT_EQ(packed_state_layout({}).total, 0);
}

TEST(GpuStateLayout, SharingByStagesKeepsTheEndsAndTheEdges) {
  // Stage 3 (the embedding) [0, 100), stage 2 [100, 200), stage 1 [200, 260) and
  // [300, 340), stage 0 (the head) [260, 300).
  const std::vector<RangeList> stages = {{{260, 40}}, {{200, 60}, {300, 40}}, {{100, 100}}, {{0, 100}}};
  const StageSharing sharing = share_by_stages({{150, 10}}, stages);
  // Own: the kept [150, 160), stages 0 and 3 whole, the first and last element of each
  // middle range (100, 199; 200, 259; 300, 339), merged.
  EXPECT_EQ(sharing.own, (RangeList{{0, 101}, {150, 10}, {199, 2}, {259, 42}, {339, 1}}));
  ASSERT_EQ(sharing.groups.size(), 2u);
  EXPECT_EQ(sharing.groups[0], (RangeList{{201, 58}, {301, 38}}));  // stage 1, pool 1
  EXPECT_EQ(sharing.groups[1], (RangeList{{101, 49}, {160, 39}}));  // stage 2, pool 0
  EXPECT_EQ(sharing.pools, (std::vector<int>{1, 0}));
  EXPECT_THROW(share_by_stages({}, {{{0, 1}}, {{1, 1}}}), Error);  // two stages: nothing in between
  EXPECT_EQ(byte_ranges({{3, 2}}, 4), (RangeList{{12, 8}}));
}

}  // namespace
}  // namespace moe
