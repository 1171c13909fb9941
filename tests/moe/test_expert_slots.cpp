// One MoE layer's slots (moe/expert_slots.h) by hand: equal blocks, a re-placed layout with
// an empty block (a hinge shared by three ranks), and what is refused.
#include <gtest/gtest.h>

#include "core/error.h"
#include "moe/dispatch.h"
#include "moe/expert_slots.h"
#include "moe/token_exchange.h"

namespace moe {
namespace {

TEST(ExpertSlots, EqualBlocks) {
  const ExpertSlots slots = equal_expert_slots(6, 3, /*split=*/true);
  EXPECT_EQ(slots.expert_of_slot, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(slots.first_slot_P1, (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_EQ(slots.window_end_P, (std::vector<int64_t>{3, 5, 6})) << "each window takes the next block's first";
  EXPECT_TRUE(slots_in_expert_order(slots));
  EXPECT_EQ(window_experts(slots, 1), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(slot_holders(slots), (std::vector<std::vector<int>>{{0}, {0}, {0, 1}, {1}, {1, 2}, {2}}));
  EXPECT_EQ(edge_cuts(slots), (std::vector<int32_t>{0, 2 * kSlotParts, 4 * kSlotParts, 6 * kSlotParts}));
  EXPECT_EQ(equal_expert_slots(6, 3, false).window_end_P, (std::vector<int64_t>{2, 4, 6}));
  EXPECT_THROW(equal_expert_slots(6, 4, false), Error);
}

TEST(ExpertSlots, ReplacedBlocksWithAWideHinge) {
  // Rank 1 holds nothing of its own: with split experts its window is slot 1 (expert 0),
  // shared with rank 0 before it and rank 2, whose block starts there.
  const std::vector<std::vector<int64_t>> blocks = {{4}, {}, {0, 5, 2, 1, 3}};
  const ExpertSlots slots = expert_slots_from_blocks(blocks, /*split=*/true);
  EXPECT_EQ(slots.expert_of_slot, (std::vector<int64_t>{4, 0, 5, 2, 1, 3}));
  EXPECT_EQ(slots.first_slot_P1, (std::vector<int64_t>{0, 1, 1, 6}));
  EXPECT_EQ(slots.window_end_P, (std::vector<int64_t>{2, 2, 6}));
  EXPECT_EQ(expert_blocks(slots), blocks);
  EXPECT_EQ(slot_of_expert(slots), (std::vector<int32_t>{1, 4, 3, 5, 0, 2}));
  EXPECT_FALSE(slots_in_expert_order(slots));
  EXPECT_EQ(window_experts(slots, 0), (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(window_experts(slots, 1), (std::vector<int64_t>{0}));
  EXPECT_EQ(slot_holders(slots)[1], (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(slot_holders(slots)[0], (std::vector<int>{0}));
  EXPECT_EQ(block_rank(slots, 0), 0);
  EXPECT_EQ(block_rank(slots, 1), 2) << "the hinge's slot is in the block of the last rank sharing it";
  EXPECT_EQ(block_rank(slots, 5), 2);
  EXPECT_THROW(block_rank(slots, 6), Error);
  const ExpertSlots whole = expert_slots_from_blocks(blocks, /*split=*/false);
  EXPECT_EQ(whole.window_end_P, (std::vector<int64_t>{1, 1, 6}));
  EXPECT_EQ(whole.window_size(1), 0);
  EXPECT_EQ(edge_cuts(whole), (std::vector<int32_t>{0, kSlotParts, kSlotParts, 6 * kSlotParts}));
  EXPECT_THROW(expert_slots_from_blocks({{0, 1}, {1, 2}}, false), Error) << "expert 1 twice";
  EXPECT_THROW(expert_slots_from_blocks({{0}, {2}}, false), Error) << "expert 2 of 2";
}

// The receiving rank's rows: chunk by chunk (chunk c of every source's block), each
// chunk's rows by slot in its token order; with one chunk, assign_rows over all.
TEST(ExpertSlots, ReceivedRowsByChunk) {
  const std::vector<int32_t> tokens_P = {3, 2};  // u 0-2 from source 0, u 3-4 from source 1
  const std::vector<int32_t> slot_UK = {0, -1, 1, 0, -1, 1, 1, -1, 0, 1};
  // Two chunks: chunk 0 = u0 (source 0's [0, 1)) and u3 (source 1's [0, 1)); chunk 1 = u1, u2, u4.
  const ReceivedRows two = lay_out_received(slot_UK.data(), tokens_P, 2, 2, 2);
  EXPECT_EQ(two.offsets_CL1, (std::vector<int32_t>{0, 1, 2, 2, 4, 7}));
  EXPECT_EQ(two.row_UK, (std::vector<int32_t>{0, -1, 4, 2, -1, 5, 1, -1, 3, 6}));
  EXPECT_EQ(two.token_of_row_R, (std::vector<int32_t>{0, 3, 1, 4, 1, 2, 4}));
  EXPECT_EQ(two.rows_L, (std::vector<int64_t>{3, 4}));
  const ReceivedRows one = lay_out_received(slot_UK.data(), tokens_P, 2, 2, 1);
  std::vector<int32_t> row(10), counts(2), offsets(3), token(10);
  const int64_t R = assign_rows(row.data(), counts.data(), offsets.data(), token.data(), slot_UK.data(), 5, 2, 2, 10);
  EXPECT_EQ(one.row_UK, row);
  EXPECT_EQ(one.offsets_CL1, offsets);
  EXPECT_EQ(one.token_of_row_R, std::vector<int32_t>(token.begin(), token.begin() + R));
  // A window without slots lays out nothing.
  const std::vector<int32_t> none(10, -1);
  const ReceivedRows empty = lay_out_received(none.data(), tokens_P, 0, 2, 2);
  EXPECT_TRUE(empty.token_of_row_R.empty());
  EXPECT_EQ(empty.row_UK, none);
}

}  // namespace
}  // namespace moe
