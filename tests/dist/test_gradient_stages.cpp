// gradient_ranges_by_stage: the stages' ranges partition the gradient block, every
// parameter lies in a range of its own stage, and a layer's parameters form one range.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/error.h"
#include "dist/gradient_stages.h"
#include "model/transformer.h"
#include "odd_sized_model.h"

namespace moe::dist {
namespace {

std::vector<int> expert_tensor_ids(const ParameterStore<float>& params) {
  std::vector<int> experts;
  for (int id = 0; id < params.size(); ++id)
    if (!params.spec(id).expert_group.empty()) experts.push_back(id);
  return experts;
}

class GradientStages : public ::testing::TestWithParam<bool> {};

TEST_P(GradientStages, PartitionTheBlockByStage) {
  Transformer<float> model(test::odd_sized_model(GetParam()), 1);
  const auto& params = model.params();
  const int n_stages = model.backward_stages();
  const auto stage_of = [&](const std::string& name) { return model.backward_stage_of(name); };
  const std::vector<RangeList> ranges = gradient_ranges_by_stage(params, stage_of, n_stages);
  ASSERT_EQ(static_cast<int>(ranges.size()), n_stages);

  // Every element of the block in exactly one range.
  RangeList all;
  for (const RangeList& stage : ranges) all.insert(all.end(), stage.begin(), stage.end());
  std::sort(all.begin(), all.end());
  int64_t covered = 0;
  for (const auto& [offset, count] : all) {
    EXPECT_EQ(offset, covered) << "gap or overlap";
    EXPECT_GT(count, 0);
    covered = offset + count;
  }
  EXPECT_EQ(covered, params.storage_numel());

  // Each parameter inside a range of its stage.
  for (int id = 0; id < params.size(); ++id) {
    const RangeList& mine = ranges[static_cast<size_t>(stage_of(params.spec(id).name))];
    const bool inside = std::any_of(mine.begin(), mine.end(), [&](const auto& r) {
      return params.offset(id) >= r.offset && params.offset(id) + params.numel(id) <= r.offset + r.count;
    });
    EXPECT_TRUE(inside) << params.spec(id).name;
  }
  // A block's parameters are registered together: one range per layer stage.
  for (int stage = 1; stage <= 3; ++stage) EXPECT_EQ(ranges[static_cast<size_t>(stage)].size(), 1u) << stage;
  // Tied: the head is the embedding, complete only at the last stage.
  if (GetParam()) {
    const int embedding = params.find("embedding");
    EXPECT_EQ(stage_of(params.spec(embedding).name), n_stages - 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Embeddings, GradientStages, ::testing::Values(false, true));

TEST(GradientStagesErrors, StageOutsideTheRangeIsAnError) {
  Transformer<float> model(test::odd_sized_model(false), 1);
  EXPECT_THROW(gradient_ranges_by_stage(model.params(), [](const std::string&) { return 7; }, 5), Error);
  EXPECT_THROW(gradient_ranges_by_stage(model.params(), [](const std::string&) { return 0; }, 0), Error);
}

// Expert parallelism: shared ranges and this rank's expert slices never overlap, every
// element of a non-expert parameter is shared, exactly this rank's experts of each expert
// tensor are its own, and the other experts' elements are in neither.
TEST(GradientStages, ExpertParallelSplitKeepsOnlyTheLocalExperts) {
  Transformer<float> model(test::odd_sized_model(false), 1);
  const auto& params = model.params();
  const int n_stages = model.backward_stages();
  const auto stage_of = [&](const std::string& name) { return model.backward_stage_of(name); };
  for (int64_t first : {0, 2}) {
    const ExpertParallelRanges split = gradient_ranges_by_stage_ep(params, stage_of, n_stages, first, 2);
    std::vector<int> owner(static_cast<size_t>(params.storage_numel()), 0);  // 1 shared, 2 own expert
    for (int s = 0; s < n_stages; ++s) {
      for (const auto& [offset, count] : split.shared[static_cast<size_t>(s)])
        for (int64_t i = offset; i < offset + count; ++i) owner[static_cast<size_t>(i)] += 1;
      for (const auto& [offset, count] : split.own_experts[static_cast<size_t>(s)])
        for (int64_t i = offset; i < offset + count; ++i) owner[static_cast<size_t>(i)] += 2;
    }
    int expert_tensors = 0;
    for (int id = 0; id < params.size(); ++id) {
      const bool is_expert = !params.spec(id).expert_group.empty();
      expert_tensors += is_expert;
      const int64_t per_expert = is_expert ? params.numel(id) / params.spec(id).shape[0] : 0;
      for (int64_t i = 0; i < params.numel(id); ++i) {
        const int64_t expert = is_expert ? i / per_expert : -1;
        const int want = !is_expert ? 1 : (expert >= first && expert < first + 2 ? 2 : 0);
        ASSERT_EQ(owner[static_cast<size_t>(params.offset(id) + i)], want) << params.spec(id).name << " element " << i;
      }
    }
    EXPECT_GT(expert_tensors, 0);
  }
  EXPECT_THROW(gradient_ranges_by_stage_ep(params, stage_of, n_stages, 3, 2), Error);  // experts 3..4 of 4
}

// After a re-placement by load a rank's slots differ per MoE layer: given as block ranges,
// exactly those are its own, each in its tensor's stage; uniform ranges give the first /
// count form's split.
TEST(GradientStages, ExpertParallelSplitFollowsPerLayerSlots) {
  Transformer<float> model(test::odd_sized_model(false), 1);
  const auto& params = model.params();
  const int n_stages = model.backward_stages();
  const auto stage_of = [&](const std::string& name) { return model.backward_stage_of(name); };
  const std::vector<int> experts = expert_tensor_ids(params);
  ASSERT_GE(experts.size(), 2u);
  // Tensor i: slots [i % 3, i % 3 + 1 + i % 2) of 4 (one or two slots, starting anywhere).
  RangeList own, uniform;
  RangeList slots_of(static_cast<size_t>(params.size()), {0, 0});
  for (size_t i = 0; i < experts.size(); ++i) {
    const int id = experts[i];
    const int64_t per_expert = params.numel(id) / params.spec(id).shape[0];
    const int64_t first = static_cast<int64_t>(i % 3), count = 1 + static_cast<int64_t>(i % 2);
    slots_of[static_cast<size_t>(id)] = {first, count};
    own.emplace_back(params.offset(id) + first * per_expert, count * per_expert);
    uniform.emplace_back(params.offset(id) + 2 * per_expert, 2 * per_expert);
  }
  std::sort(own.begin(), own.end());
  std::sort(uniform.begin(), uniform.end());
  const ExpertParallelRanges split = gradient_ranges_by_stage_ep(params, stage_of, n_stages, own);
  std::vector<int> stage_of_own(static_cast<size_t>(params.storage_numel()), -1);
  for (int s = 0; s < n_stages; ++s)
    for (const auto& [offset, count] : split.own_experts[static_cast<size_t>(s)])
      for (int64_t i = offset; i < offset + count; ++i) stage_of_own[static_cast<size_t>(i)] = s;
  for (int id : experts) {
    const int64_t per_expert = params.numel(id) / params.spec(id).shape[0];
    const auto [first, count] = slots_of[static_cast<size_t>(id)];
    for (int64_t i = 0; i < params.numel(id); ++i) {
      const int64_t slot = i / per_expert;
      const int want = slot >= first && slot < first + count ? stage_of(params.spec(id).name) : -1;
      ASSERT_EQ(stage_of_own[static_cast<size_t>(params.offset(id) + i)], want) << params.spec(id).name << " " << i;
    }
  }
  // What the optimizer steps: every shared element and exactly the own slots, merged.
  const RangeList stepped = split.stepped();
  std::vector<char> in_stepped(static_cast<size_t>(params.storage_numel()), 0);
  for (size_t i = 0; i < stepped.size(); ++i) {
    if (i > 0) EXPECT_LT(stepped[i - 1].offset + stepped[i - 1].count, stepped[i].offset) << "not merged or sorted";
    for (int64_t e = stepped[i].offset; e < stepped[i].offset + stepped[i].count; ++e) in_stepped[static_cast<size_t>(e)] = 1;
  }
  std::vector<char> want_stepped(static_cast<size_t>(params.storage_numel()), 0);
  for (const auto* sets : {&split.shared, &split.own_experts})
    for (const RangeList& stage : *sets)
      for (const auto& [offset, count] : stage)
        for (int64_t e = offset; e < offset + count; ++e) want_stepped[static_cast<size_t>(e)] = 1;
  EXPECT_EQ(in_stepped, want_stepped);
  EXPECT_THROW(merged_ranges({{{{0, 4}}}, {{{2, 4}}}}), Error);  // overlapping
  const ExpertParallelRanges by_count = gradient_ranges_by_stage_ep(params, stage_of, n_stages, 2, 2);
  const ExpertParallelRanges by_ranges = gradient_ranges_by_stage_ep(params, stage_of, n_stages, uniform);
  EXPECT_EQ(by_count.own_experts, by_ranges.own_experts);
  EXPECT_EQ(by_count.shared, by_ranges.shared);
  // A range reaching past its tensor is an error.
  const int last = experts.back();
  EXPECT_THROW(gradient_ranges_by_stage_ep(params, stage_of, n_stages,
                                           RangeList{{params.offset(last) + 1, params.numel(last)}}),
               Error);
}

// Split experts: every rank sums the hinge slots over all ranks (they are in `shared`, the
// same on every rank, its own hinge or not), they leave `own_experts`, and a rank steps
// the hinges of its window only.
TEST(GradientStages, ExpertParallelHingesAreSummedOverAllRanks) {
  Transformer<float> model(test::odd_sized_model(false), 1);
  const auto& params = model.params();
  const int n_stages = model.backward_stages();
  const auto stage_of = [&](const std::string& name) { return model.backward_stage_of(name); };
  const std::vector<int> experts = expert_tensor_ids(params);
  // 4 experts over 2 ranks, split: rank 0's window is slots 0-2, rank 1's 2-3; slot 2 the hinge.
  RangeList window0, window1, hinges;
  for (int id : experts) {
    const int64_t per_expert = params.numel(id) / 4;
    window0.emplace_back(params.offset(id), 3 * per_expert);
    window1.emplace_back(params.offset(id) + 2 * per_expert, 2 * per_expert);
    hinges.emplace_back(params.offset(id) + 2 * per_expert, per_expert);
  }
  std::sort(window0.begin(), window0.end());
  std::sort(window1.begin(), window1.end());
  std::sort(hinges.begin(), hinges.end());
  const ExpertParallelRanges rank0 = gradient_ranges_by_stage_ep(params, stage_of, n_stages, window0, hinges);
  const ExpertParallelRanges rank1 = gradient_ranges_by_stage_ep(params, stage_of, n_stages, window1, hinges);
  EXPECT_EQ(rank0.shared, rank1.shared) << "the sums over all ranks must match";
  auto marks = [&](const std::vector<RangeList>& stages) {
    std::vector<char> in(static_cast<size_t>(params.storage_numel()), 0);
    for (const RangeList& stage : stages)
      for (const auto& [offset, count] : stage)
        for (int64_t e = offset; e < offset + count; ++e) in[static_cast<size_t>(e)] = 1;
    return in;
  };
  const std::vector<char> shared = marks(rank0.shared), own0 = marks(rank0.own_experts), own1 = marks(rank1.own_experts);
  const std::vector<char> stepped0 = marks({rank0.stepped()}), stepped1 = marks({rank1.stepped()});
  for (int id : experts) {
    const int64_t per_expert = params.numel(id) / 4;
    for (int64_t i = 0; i < params.numel(id); ++i) {
      const size_t at = static_cast<size_t>(params.offset(id) + i);
      const int64_t slot = i / per_expert;
      ASSERT_EQ(shared[at], slot == 2) << params.spec(id).name << " " << i;
      ASSERT_EQ(own0[at], slot < 2);
      ASSERT_EQ(own1[at], slot == 3);
      ASSERT_EQ(stepped0[at], slot <= 2);
      ASSERT_EQ(stepped1[at], slot >= 2);
    }
  }
  // Every non-expert element is shared and stepped by both.
  const int router = 0;
  ASSERT_TRUE(params.spec(router).expert_group.empty());
  EXPECT_TRUE(shared[static_cast<size_t>(params.offset(router))] && stepped0[static_cast<size_t>(params.offset(router))] &&
              stepped1[static_cast<size_t>(params.offset(router))]);
}

}  // namespace
}  // namespace moe::dist
