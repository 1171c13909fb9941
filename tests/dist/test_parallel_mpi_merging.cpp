// Expert merging (moe.merge_interval) over 4 ranks (label mpi): data parallelism at every
// ZeRO level and expert parallelism (EP 2 x DP 2, EP 4, with re-placement by load) must
// take the merges of the single-process run and train as it does
// (ParallelCpuBackend::merge_experts rebuilds the merged layers whole on every rank from
// the ranks' pieces and keeps its own part). A merge that lost or doubled a piece, or
// that a rank took differently, shows in the losses and weights from the first event on.
// Tolerances: parallel_training.h's (the merge itself is exact: the same bits on every
// rank; only the training around it differs by the order of fp32 sums).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "parallel_mpi_world.h"
#include "parallel_training.h"

namespace moe {
namespace {

using dist::testing::parallel_world;
using namespace test_parallel;

// 8 experts (EP 4: 2 per rank), 2 pairs per layer merged every 4 steps whatever their
// cosine: 10 events in 40 steps, each freeing 2 experts of every MoE layer (enough steps
// for the run to learn, which expect_matches_reference asks of the reference).
RunConfig merging_config(int64_t ep, int64_t zero) {
  RunConfig config = tiny_config();
  config.training.steps = 40;
  config.model.moe.n_experts = 8;
  config.model.moe.merge_interval = 4;
  config.model.moe.merge_similarity = -1;
  config.model.moe.merge_pairs = 2;
  // A freed expert starts as a near-copy of its source (router row exact): near-ties that
  // fp32 summation order can flip. At the default 0.01 the runs part at step ~12; at 0.1
  // the copies diverge sooner and most layouts route alike all 40 steps (final weights compared).
  config.model.moe.merge_noise = 0.1;
  config.parallel.expert_parallel = ep;
  config.parallel.zero = zero;
  return config;
}

// The run's merges as numbers, step by step (step, layer, kept, freed, split_of,
// similarity, kept share).
std::vector<double> merge_log(const RunResult& run) {
  std::vector<double> log;
  for (const StepStats& s : run.stats)
    for (size_t l = 0; l < s.layers.size(); ++l)
      for (const MergeRecord& m : s.layers[l].merges)
        log.insert(log.end(), {double(s.step), double(l), double(m.kept), double(m.freed), double(m.split_of),
                               m.similarity, m.kept_share});
  return log;
}

// Every rank reports the same merges, bit for bit; rank 0's are the one-process run's
// (the same pairs; the cosines to the weights' rounding) while the two runs route alike
// (a merge weighs by its step's loads; expect_matches_reference asks >= 10 such steps).
void expect_merges_as_in_one_process(const RunConfig& config, const RunResult& got) {
  const std::vector<double> mine = merge_log(got);
  auto& world = *parallel_world();
  int64_t n = static_cast<int64_t>(mine.size());
  world.broadcast(&n, 1, dist::DType::i64, 0);
  ASSERT_EQ(static_cast<int64_t>(mine.size()), n) << "rank " << world.rank() << " merged another number of pairs";
  std::vector<double> rank0 = mine;
  world.broadcast(rank0.data(), rank0.size(), dist::DType::f64, 0);
  EXPECT_EQ(std::memcmp(rank0.data(), mine.data(), mine.size() * sizeof(double)), 0)
      << "rank " << world.rank() << " merged otherwise than rank 0";
  const auto events = config.training.steps / config.model.moe.merge_interval;
  const auto layers = config.model.n_layers - config.model.first_dense_layers;
  EXPECT_EQ(n, 7 * events * layers * config.model.moe.merge_pairs) << "the test needs every event to merge";
  if (world.rank() != 0) return;
  const RunResult& one = reference(config);
  const auto alike = static_cast<double>(first_routing_difference(got, one));
  const std::vector<double> want = merge_log(one);
  ASSERT_EQ(mine.size(), want.size());
  size_t compared = 0;
  for (size_t i = 0; i < mine.size() && mine[i] <= alike && want[i] <= alike; i += 7, ++compared) {
    for (size_t k = 0; k < 5; ++k) EXPECT_EQ(mine[i + k], want[i + k]) << "merge record " << i / 7 << " field " << k;
    EXPECT_NEAR(mine[i + 5], want[i + 5], 1e-4) << "cosine of merge " << i / 7;
    EXPECT_NEAR(mine[i + 6], want[i + 6], 1e-12) << "kept share of merge " << i / 7;
  }
  EXPECT_GT(compared, 0u);
}

// Data parallelism (ZeRO-1), EP 2 x DP 2 with the balancing bias (merged too), EP 4.
TEST(ParallelMerging, DataAndExpertParallelMatchOneProcess) {
  ASSERT_EQ(parallel_world()->size(), 4);
  for (int64_t ep : {1, 2, 4}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    RunConfig config = merging_config(ep, 1);
    config.model.moe.bias_balancing = ep == 2;
    const RunResult got = train_parallel(config);
    expect_matches_reference(config, got);
    expect_merges_as_in_one_process(config, got);
  }
}

// ZeRO 0, 2, 3 (sharded moments, released gradients, sharded weights) under data
// parallelism; EP 2 at ZeRO-3 (experts sharded over their replicas) with re-placement by
// load every 2 steps (the merge works on expert ids, wherever their slots are); EP 4 with
// split experts (a hinge's weights and moments on two ranks).
TEST(ParallelMerging, ZeroLevelsRebalancedAndSplitExpertsMatchOneProcess) {
  struct Layout {
    int64_t ep, zero;
    bool split;
  };
  for (const Layout& layout : std::vector<Layout>{{1, 0, false}, {1, 2, false}, {1, 3, false}, {2, 3, false}, {4, 1, true}}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(layout.ep) + ", zero " + std::to_string(layout.zero) +
                 (layout.split ? ", split experts" : ""));
    RunConfig config = merging_config(layout.ep, layout.zero);
    if (layout.ep == 2) config.parallel.rebalance_interval = 2;
    config.parallel.split_experts = layout.split;
    const RunResult got = train_parallel(config);
    expect_matches_reference(config, got);
    expect_merges_as_in_one_process(config, got);
  }
}

// A 4-rank run with merging, checkpointed after a merge event (step 4) and resumed on the
// same ranks, continues bit for bit through the next events (steps 6 and 8): the merged
// state is in the ranks' pieces and the protected experts in the trainer's record.
TEST(ParallelMerging, ResumeContinuesThroughMergeEvents) {
  for (const auto& [ep, zero] : std::vector<std::pair<int64_t, int64_t>>{{1, 3}, {2, 1}}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep) + ", zero " + std::to_string(zero));
    const std::filesystem::path dir = shared_dir("merge_resume_" + std::to_string(ep), true);
    RunConfig config = merging_config(ep, zero);
    config.model.vocab_size = 257;  // a config that validates (checkpoints re-read it); the task uses 16 ids
    config.model.moe.merge_interval = 2;
    config.training.steps = 8;
    config.checkpoint.dir = dir.string();
    config.checkpoint.interval = 4;
    const RunResult whole = train_parallel(config);
    ASSERT_TRUE(std::filesystem::exists(dir / "step_00000004" / "COMPLETE"));
    config.checkpoint.dir = (dir / "resumed").string();
    const RunResult resumed = train_parallel(config, (dir / "step_00000004").string());
    ASSERT_EQ(resumed.loss.size(), 4u);
    EXPECT_EQ(resumed.loss, std::vector<double>(whole.loss.begin() + 4, whole.loss.end()));
    EXPECT_EQ(resumed.params, whole.params);
    const std::vector<double> all = merge_log(whole);  // events at steps 2, 4, 6, 8: 2 layers x 2 pairs x 7
    ASSERT_EQ(all.size(), 4u * 28u);
    EXPECT_EQ(merge_log(resumed), std::vector<double>(all.begin() + 2 * 28, all.end())) << "the events after the resume";
    remove_shared_dir(dir);
  }
}

}  // namespace
}  // namespace moe
