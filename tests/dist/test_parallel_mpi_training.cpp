// N ranks against one process (label mpi, run under mpirun -np 4): 20 training steps
// with data parallelism (ZeRO-1), expert parallelism and both must give the losses and
// final parameters of the single-process run with an N times larger micro-batch (the
// same global batch and micro-batch split; see src/train/backends/parallel_cpu_backend.h).
//
// Tolerances: the runs differ only in the order of fp32 sums (gradients summed per rank
// then across ranks, expert GEMMs over row segments, reduce-scatter order, and under
// expert parallelism a token's expert outputs summed as per-rank partial combines, each
// rounded to fp32, instead of one double sum). Such differences start at ~1e-7 relative
// and grow through 20 Adam steps, whose update m / sqrt(v) amplifies them for parameters
// with near-zero gradients. Measured (4 ranks, x86-64): losses within 2e-7 relative and
// parameters within 2.4e-5 of max(1, |w|) in the runs that route alike to the end; the
// aux loss (sums of near-equal mean scores) up to 3e-6 relative in the run that parts at
// step 19. The checks, relative 1e-5 on the losses and 2e-4 on the parameters, hold with
// that margin, while any real mistake (a missing rank's gradient, a wrong token, a wrong
// loss weight, an unsummed hinge) is orders of magnitude larger, as the first steps'
// losses already show.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <numeric>
#include <sstream>

#include "core/atomic_file.h"
#include "dist/expert_exchange.h"
#include "dist/launch_env.h"
#include <nlohmann/json.hpp>

#include "dist/single_communicator.h"
#include "moe/expert_placement.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "parallel_mpi_world.h"
#include "parallel_training.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe {
namespace {

using dist::testing::parallel_world;
using namespace test_parallel;  // the runs and comparisons, shared with the ZeRO-level tests


TEST(ParallelTraining, DataParallelZero1MatchesOneProcess) {
  ASSERT_EQ(parallel_world()->size(), 4);
  RunConfig config = tiny_config();
  config.parallel.bucket_mb = 0;  // one bucket per backward stage (layer)
  const RunResult got = train_parallel(config);
  expect_matches_reference(config, got);
  for (const StepStats& s : got.stats) {
    EXPECT_GT(s.grad_sync_ms, 0);
    EXPECT_GT(s.time.comm_wait, 0);
    EXPECT_EQ(s.a2a_bytes, 0);  // no expert parallelism
  }
}

TEST(ParallelTraining, ExpertParallel4MatchesOneProcess) {
  RunConfig config = tiny_config();
  config.parallel.expert_parallel = 4;
  const RunResult got = train_parallel(config);
  expect_matches_reference(config, got);
  for (const StepStats& s : got.stats) {
    EXPECT_GT(s.a2a_bytes, 0);
    EXPECT_GT(s.a2a_seconds, 0);
    if (dist::read_launch_env().n_nodes == 1) EXPECT_EQ(s.a2a_off_node_bytes, 0);  // one node: nothing leaves it
    ASSERT_EQ(s.ranks.size(), 4u);
    EXPECT_EQ(s.ranks[1].experts, std::vector<int64_t>{1});
  }
}

TEST(ParallelTraining, DataParallel2xExpertParallel2MatchesOneProcess) {
  RunConfig config = tiny_config();
  config.parallel.expert_parallel = 2;
  config.parallel.a2a_chunks = 3;       // overlapped exchange in chunks
  config.parallel.bucket_mb = 0.005;    // 1216-element buckets: several per layer
  expect_matches_reference(config, train_parallel(config));
}

// Capacity is per expert over the global micro-batch, dropping by global position. Over
// more steps, rounding-order differences eventually move a router score across a top-k
// or capacity boundary and one assignment more or less is dropped (seen at step 20 of
// this run): a discrete event no tolerance covers, so this run is shorter.
TEST(ParallelTraining, CapacityDropsAsInOneProcess) {
  RunConfig config = tiny_config();
  config.training.steps = 15;
  config.model.moe.capacity_factor = 1.0;
  config.parallel.expert_parallel = 2;
  const RunResult got = train_parallel(config);
  expect_matches_reference(config, got);
  ASSERT_EQ(got.dropped.size(), 15u);
  int64_t dropped = 0;
  for (int64_t d : got.dropped) dropped += d;
  EXPECT_GT(dropped, 0) << "the test needs capacity to drop something";
}

TEST(ParallelTraining, ExpertClippingAndBiasBalancing) {
  for (int64_t ep : {1, 2}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    RunConfig config = tiny_config();
    config.training.expert_grad_clip = 0.02;  // expert norms are 0.006-0.034 here: it fires for some
    config.model.moe.bias_balancing = true;
    config.model.moe.score_func = ScoreFunc::Sigmoid;
    config.parallel.expert_parallel = ep;
    expect_matches_reference(config, train_parallel(config));
  }
}

// Dynamic load balancing: every 2 steps the experts are placed again by load (2 per EP
// rank; 2 EP groups, each moving its experts' moments), moved experts taking their
// weights and moments along. Where an expert is computed changes nothing in the math, so
// the run still matches one process; and the placement did change. (With one expert per
// rank there is nothing to gain and nothing moves.)
TEST(ParallelTraining, RebalancedExpertsMatchOneProcess) {
  for (int64_t ep : {2}) {
    RunConfig config = tiny_config();
    config.parallel.expert_parallel = ep;
    config.parallel.rebalance_interval = 2;
    const RunResult got = train_parallel(config);
    expect_matches_reference(config, got);
    const auto contiguous = ExpertPlacement::contiguous(config.model.moe.n_experts, static_cast<int>(ep));
    int moved = 0;
    for (const StepStats& s : got.stats) {
      ASSERT_EQ(s.ranks.size(), static_cast<size_t>(ep));
      for (const RankLoad& r : s.ranks) moved += r.experts != contiguous.experts_of(static_cast<int>(r.rank));
    }
    EXPECT_GT(moved, 0) << "the test needs the placement to change";
  }
}

using LayerBlocks = std::vector<std::vector<std::vector<int64_t>>>;  // per MoE layer, per EP rank

// Each step's placement (per MoE layer, each rank's block of experts), from checkpoints
// written after every step into `dir` (ModelBackend::placement_state).
std::vector<LayerBlocks> placements_by_step(const std::filesystem::path& dir) {
  std::vector<LayerBlocks> steps;
  for (const CheckpointListing& listing : list_checkpoints(dir)) {
    const nlohmann::json state = nlohmann::json::parse(read_checkpoint(listing.path).expert_placement);
    steps.push_back(state.at("experts_of_rank").get<LayerBlocks>());
  }
  return steps;
}

// Checkpoints after every step, all kept. (A checkpoint's config must validate: the byte
// tokenizer wants 257 ids, a BPE one to be trained does not; the task feeds its own 16.)
void checkpoint_every_step(RunConfig& config, const std::filesystem::path& dir) {
  config.data.tokenizer = "bpe:258";
  config.checkpoint.dir = dir.string();
  config.checkpoint.interval = 1;
  config.checkpoint.keep_last = config.training.steps;
}

// parallel.rebalance_max_experts: the ranks may hold different numbers of experts after a
// re-placement (up to 3 of the 4 here, per MoE layer); the run still matches one process.
TEST(ParallelTraining, UnequalExpertCountsMatchOneProcess) {
  RunConfig config = tiny_config();
  config.parallel.expert_parallel = 2;
  config.parallel.rebalance_interval = 1;
  config.parallel.rebalance_max_experts = 3;
  const std::filesystem::path dir = shared_dir("unequal");
  checkpoint_every_step(config, dir);
  const RunResult got = train_parallel(config);
  expect_matches_reference(config, got);
  size_t most = 0;
  for (const LayerBlocks& layers : placements_by_step(dir))
    for (const auto& blocks : layers)
      for (const auto& block : blocks) most = std::max(most, block.size());
  EXPECT_EQ(most, 3u) << "the test needs a re-placement with unequal counts";
  remove_shared_dir(dir);
}

// Split experts: each EP rank also computes part of the next block's first expert (the
// hinge), the boundary set every micro-batch from every rank's kept rows. A hot expert 2
// (the hinge of EP 2's equal blocks) loads rank 1 with about twice rank 0's rows unless the
// hinge moves; where rows are computed changes nothing in the math, so the run matches one
// process (EP 2 over 2 data-parallel groups, whose hinges move apart, and EP 4).
// (tests/model/test_expert_parallel_dispatcher.cpp checks the rows per rank against the cuts.)
TEST(ParallelTraining, SplitExpertsMatchOneProcess) {
  for (int64_t ep : {2, 4}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    RunConfig config = tiny_config();
    config.parallel.expert_parallel = ep;
    config.parallel.split_experts = true;
    config.parallel.a2a_chunks = ep == 2 ? 2 : 1;
    expect_matches_reference(config, train_parallel(config, "", hot_expert_2), hot_expert_2);
  }
}

// Split experts re-placed by load every 2 steps: the hot expert becomes the first hinge
// (hinged_placement; later re-placements follow the load as the router evens out), the
// moved experts' weights and moments follow, and the run matches one process.
TEST(ParallelTraining, SplitExpertsRebalancedMatchOneProcess) {
  RunConfig config = tiny_config();
  config.model.moe.n_experts = 8;
  config.parallel.expert_parallel = 4;
  config.parallel.split_experts = true;
  config.parallel.rebalance_interval = 2;
  const std::filesystem::path dir = shared_dir("split_rebalanced");
  checkpoint_every_step(config, dir);
  const RunResult got = train_parallel(config, "", hot_expert_2);
  expect_matches_reference(config, got, hot_expert_2);
  const std::vector<LayerBlocks> placed = placements_by_step(dir);
  ASSERT_EQ(placed.size(), got.loss.size());
  const LayerBlocks equal(2, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  EXPECT_EQ(placed[0], equal) << "the equal blocks until the first re-placement";
  ASSERT_NE(placed[1], equal) << "re-placed after step 2 (the hot expert's block was the busiest)";
  for (const auto& blocks : placed[1]) {
    // The hot expert is the first hinge (rank 1's first slot), the others whole.
    ASSERT_EQ(blocks.size(), 4u);
    ASSERT_FALSE(blocks[1].empty());
    EXPECT_EQ(blocks[1].front(), 2) << nlohmann::json(blocks).dump();
  }
  remove_shared_dir(dir);
}

// Checkpoints of a multi-rank run: every rank writes its own shard (its ZeRO moments, the
// experts whose block it holds, its share of the replicated parameters), rank 0 the
// manifest, and a run resumed from it on the same ranks continues bit for bit: the losses
// and final parameters of the uninterrupted run; one process resumes it as well.
TEST(ParallelTraining, CheckpointAndResumeContinueTheRun) {
  auto& world = *parallel_world();
  int64_t pid = world.rank() == 0 ? static_cast<int64_t>(getpid()) : 0;
  world.broadcast(&pid, 1, dist::DType::i64, 0);  // one directory for all ranks, named by rank 0
  // ep 3 stands for EP 2 re-placed after every step, 4 for EP 2 with split experts
  // re-placed every step: the checkpoint keeps each layer's placement (the grouping of the
  // partial combines depends on it, so a resumed run is bit for bit only with it; the
  // resumed steps' placement is compared too).
  for (int64_t ep : {1, 2, 3, 4}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() / ("moe_mpi_ckpt_" + std::to_string(pid) + "_" + std::to_string(ep));
    RunConfig config = tiny_config();
    config.model.vocab_size = 257;  // a config that validates (checkpoints store and re-read it); the task uses 16 ids
    config.training.steps = 8;
    config.parallel.expert_parallel = std::min<int64_t>(ep, 2);
    if (ep >= 3) {
      config.parallel.rebalance_interval = 1;
      config.parallel.rebalance_max_experts = 3;
      config.parallel.split_experts = ep == 4;
    }
    config.checkpoint.dir = dir.string();
    config.checkpoint.interval = 4;
    const RunResult whole = train_parallel(config);
    ASSERT_EQ(whole.loss.size(), 8u);
    ASSERT_TRUE(std::filesystem::exists(dir / "step_00000004" / "COMPLETE"));
    config.checkpoint.dir = (dir / "resumed").string();  // dir holds step 8: resuming step 4 there is refused
    const RunResult resumed = train_parallel(config, (dir / "step_00000004").string());
    ASSERT_EQ(resumed.loss.size(), 4u);
    EXPECT_EQ(resumed.loss, std::vector<double>(whole.loss.begin() + 4, whole.loss.end()));
    EXPECT_EQ(resumed.grad_norm, std::vector<double>(whole.grad_norm.begin() + 4, whole.grad_norm.end()));
    EXPECT_EQ(resumed.params, whole.params);
    if (ep >= 3) {
      auto experts = [](const StepStats& s) {
        std::vector<std::vector<int64_t>> held;
        for (const RankLoad& rank : s.ranks) held.push_back(rank.experts);
        return held;
      };
      EXPECT_NE(experts(whole.stats[4]), (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}}))
          << "the case should start step 5 re-placed";
      for (size_t i = 0; i < 4; ++i)
        EXPECT_EQ(experts(resumed.stats[i]), experts(whole.stats[i + 4])) << "step " << i + 5;
    }
    // One process with the same global batch reads every shard and continues it too (up
    // to the order of sums).
    if (world.rank() == 0) {
      RunConfig single = config;
      single.training.micro_batch *= world.size();
      single.parallel = ParallelConfig{};
      single.checkpoint.dir = (dir / "single").string();
      const RunResult alone = train(single, dist::make_single_communicator(), (dir / "step_00000004").string());
      expect_close(alone.loss, resumed.loss, 1e-5, "one process resuming the 4-rank checkpoint");
    }
    world.barrier();
    if (world.rank() == 0) std::filesystem::remove_all(dir);
  }
}

// Resharding without a step between: the state 4 ranks save (ZeRO-1 pieces, EP 2 blocks),
// resumed by 2 ranks and by one process and saved again, is the same, tensor by tensor,
// bit for bit: each layout reads the slices it needs and writes its own.
TEST(ParallelTraining, CheckpointIsTheSameSavedOnAnyNumberOfRanks) {
  auto& world = *parallel_world();
  ASSERT_EQ(world.size(), 4);
  int64_t pid = world.rank() == 0 ? static_cast<int64_t>(getpid()) : 0;
  world.broadcast(&pid, 1, dist::DType::i64, 0);
  for (int64_t ep : {1, 2}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                      ("moe_mpi_ckpt_ranks_" + std::to_string(pid) + "_" + std::to_string(ep));
    RunConfig config = tiny_config();
    config.model.vocab_size = 257;  // a config that validates (checkpoints store and re-read it)
    config.training.steps = 3;
    config.parallel.expert_parallel = ep;
    config.parallel.bucket_mb = 0.002;  // several buckets per stage, ragged tails
    config.checkpoint.dir = (dir / "ranks_4").string();
    config.checkpoint.interval = 3;
    train_parallel(config);
    const std::filesystem::path saved = dir / "ranks_4" / "step_00000003";
    // Ranks 0-1 resume it as a 2-rank run, rank 2 as one process (rank 3 waits).
    const int color = world.rank() < 2 ? 0 : world.rank();
    std::unique_ptr<dist::Communicator> group = world.split(color, world.rank());
    if (color < 3) {
      RunConfig again = config;
      again.training.micro_batch *= world.size() / group->size();  // the same global micro-batch
      if (group->size() == 1) again.parallel = ParallelConfig{};
      again.checkpoint.dir = (dir / ("resaved_" + std::to_string(color))).string();
      const auto trainer = make_trainer(again, std::move(group));
      std::ostringstream log;
      trainer->resume(saved.string(), log);
      trainer->save_checkpoint(log);
    }
    world.barrier();
    if (world.rank() == 0) {
      EXPECT_EQ(read_checkpoint(saved).manifest.world_size, 4);
      EXPECT_EQ(read_checkpoint(dir / "resaved_0" / "step_00000003").manifest.world_size, 2);
      const auto want = saved_tensors(saved);
      for (const char* resaved : {"resaved_0", "resaved_2"}) {
        const auto got = saved_tensors(dir / resaved / "step_00000003");
        ASSERT_EQ(got.size(), want.size()) << resaved;
        for (const auto& [name, values] : want) EXPECT_TRUE(got.at(name) == values) << resaved << ": " << name;
      }
      std::filesystem::remove_all(dir);
    }
    world.barrier();
  }
}

// Resuming reshards: 8 steps at 4 ranks (EP 4; EP 1, i.e. data parallel with ZeRO-1, saving
// with checkpoint.async) saved after step 4, resumed at 2 ranks (EP 2 / 1) and at one process, which follow the
// uninterrupted run up to the order of sums, and back at 4 ranks from the 2 ranks' save
// of the same state, which follows it bit for bit (the layout is the one that trained).
TEST(ParallelTraining, ResumeReshardsAcrossLayouts) {
  auto& world = *parallel_world();
  ASSERT_EQ(world.size(), 4);
  int64_t pid = world.rank() == 0 ? static_cast<int64_t>(getpid()) : 0;
  world.broadcast(&pid, 1, dist::DType::i64, 0);
  for (int64_t ep : {4, 1}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                      ("moe_mpi_reshard_" + std::to_string(pid) + "_" + std::to_string(ep));
    RunConfig config = tiny_config();
    config.model.vocab_size = 257;  // a config that validates (checkpoints store and re-read it)
    config.training.steps = 8;
    config.parallel.expert_parallel = ep;
    config.checkpoint.dir = (dir / "ranks_4").string();
    config.checkpoint.interval = 4;
    config.checkpoint.async = ep == 1;  // rank 0's writer waits for the others' shards in the background
    const RunResult whole = train_parallel(config);
    ASSERT_EQ(whole.loss.size(), 8u);
    const std::filesystem::path saved = dir / "ranks_4" / "step_00000004";
    ASSERT_TRUE(std::filesystem::exists(saved / "COMPLETE"));
    const std::vector<double> rest(whole.loss.begin() + 4, whole.loss.end());
    // At 2 ranks (ranks 0-1) and at one process (rank 2); the 2 ranks save the state
    // they resumed before training on.
    const int color = world.rank() < 2 ? 0 : world.rank();
    std::unique_ptr<dist::Communicator> group = world.split(color, world.rank());
    if (color < 3) {
      RunConfig fewer = config;
      fewer.training.micro_batch *= world.size() / group->size();  // the same global micro-batch
      fewer.parallel.expert_parallel = std::min<int64_t>(ep, group->size());
      if (group->size() == 1) fewer.parallel = ParallelConfig{};
      fewer.checkpoint.dir = (dir / ("fewer_" + std::to_string(color))).string();
      fewer.checkpoint.interval = 0;
      const auto m = fewer.model;
      Trainer trainer(fewer, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                      std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2), std::move(group));
      std::ostringstream log;
      trainer.resume(saved.string(), log);
      EXPECT_NE(log.str().find("written by 4 ranks, EP " + std::to_string(ep)), std::string::npos) << log.str();
      if (color == 0) trainer.save_checkpoint(log);
      std::vector<double> losses;
      trainer.on_step = [&](const StepStats& s) { losses.push_back(s.loss); };
      trainer.run(log);
      if (world.rank() == 0 || world.rank() == 2)
        expect_close(losses, rest, 1e-5, color == 0 ? "2 ranks resuming 4 ranks' checkpoint" : "one process resuming it");
    }
    world.barrier();
    // Back at 4 ranks, from the 2 ranks' save.
    RunConfig back = config;
    back.checkpoint.dir = (dir / "back").string();
    const RunResult resumed = train_parallel(back, (dir / "fewer_0" / "step_00000004").string());
    EXPECT_EQ(resumed.loss, rest);
    EXPECT_EQ(resumed.params, whole.params);
    world.barrier();
    if (world.rank() == 0) std::filesystem::remove_all(dir);
    world.barrier();
  }
}

// `moe export` of a checkpoint 4 ranks wrote (EP 2: experts split over the shards, the
// rest in shares): tensor by tensor, the same Mixtral files as the export of the same
// state saved by one process, in one file and in many.
TEST(ParallelTraining, ExportReadsAShardedCheckpoint) {
  auto& world = *parallel_world();
  int64_t pid = world.rank() == 0 ? static_cast<int64_t>(getpid()) : 0;
  world.broadcast(&pid, 1, dist::DType::i64, 0);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("moe_mpi_export_" + std::to_string(pid));
  RunConfig config = tiny_config();
  config.model.vocab_size = 257;  // a config that validates (checkpoints store and re-read it)
  config.model.moe.n_shared_experts = 0;  // Mixtral has none
  config.training.steps = 2;
  config.parallel.expert_parallel = 2;
  config.checkpoint.dir = (dir / "ranks_4").string();
  train_parallel(config);
  world.barrier();
  if (world.rank() == 0) {
    const std::filesystem::path saved = dir / "ranks_4" / "step_00000002";
    ASSERT_EQ(read_checkpoint(saved).manifest.world_size, 4);
    RunConfig single = config;
    single.training.micro_batch *= world.size();
    single.parallel = ParallelConfig{};
    single.checkpoint.dir = (dir / "single").string();
    const auto trainer = make_trainer(single, dist::make_single_communicator());
    std::ostringstream log;
    trainer->resume(saved.string(), log);
    trainer->save_checkpoint(log);
    for (uint64_t max_bytes : {uint64_t{5000000000}, uint64_t{20000}}) {
      SCOPED_TRACE(max_bytes);
      const std::string tag = std::to_string(max_bytes);
      for (const char* from : {"ranks_4", "single"}) {
        ExportOptions options;
        options.checkpoint = (dir / from / "step_00000002").string();
        options.output = (dir / ("hf_" + tag + "_" + from)).string();
        options.max_shard_bytes = max_bytes;
        options.allow_inexact = true;  // the trained router biases are dropped (a warning)
        export_checkpoint(options, log);
      }
      size_t files = 0;
      for (const auto& entry : std::filesystem::directory_iterator(dir / ("hf_" + tag + "_single"))) {
        const std::string name = entry.path().filename().string();
        ++files;
        EXPECT_TRUE(read_file_bytes(entry.path()) == read_file_bytes(dir / ("hf_" + tag + "_ranks_4") / name)) << name;
      }
      EXPECT_GE(files, max_bytes == 20000 ? 4u : 2u) << "config.json, weights (and an index)";
    }
    std::filesystem::remove_all(dir);
  }
  world.barrier();
}

// Known answers of one step on the ranks (the comparisons above hold only where clipping,
// entropy or the bias update change something).

// Per-expert clipping over the ranks, sharded (EP 1: an expert's elements may lie on
// several ranks) and expert-parallel (EP 2, 4), with a threshold that clips about half
// of the experts: the step's norm after clipping is the one worked out from the one-process
// run's unclipped gradients, each expert of norm n > c scaled by c / (n + 1e-6).
TEST(ParallelTraining, ExpertClippingMatchesHandComputedNorms) {
  RunConfig config = tiny_config();
  config.training.grad_clip = 0;
  config.training.expert_grad_clip = 0;
  RunConfig single = config;
  single.training.micro_batch *= parallel_world()->size();
  single.parallel = ParallelConfig{};
  auto one = make_trainer(single, dist::make_single_communicator());
  one->train_step(0);
  auto& params = one->model().params();
  double dense_sq = 0;
  std::map<std::string, std::vector<double>> expert_sq;  // expert group -> per expert
  for (int id = 0; id < params.size(); ++id) {
    const ParamSpec& spec = params.spec(id);
    const int64_t n = params.numel(id), E = spec.expert_group.empty() ? 1 : spec.shape[0];
    auto& sums = expert_sq[spec.expert_group];
    sums.resize(static_cast<size_t>(E), 0.0);
    for (int64_t i = 0; i < n; ++i) sums[static_cast<size_t>(i / (n / E))] += double(params.grad(id)[i]) * params.grad(id)[i];
  }
  dense_sq = expert_sq[""][0];
  expert_sq.erase("");
  std::vector<double> norms;
  for (const auto& [group, sums] : expert_sq)
    for (double sq : sums) norms.push_back(std::sqrt(sq));
  ASSERT_EQ(norms.size(), 8u);  // 2 MoE layers x 4 experts
  std::vector<double> sorted = norms;
  std::sort(sorted.begin(), sorted.end());
  const double clip = (sorted[3] + sorted[4]) / 2;
  // Between the norms and their squares (all below 1), so comparing squares would clip none.
  ASSERT_LT(sorted.back(), std::sqrt(clip));
  double clipped_sq = dense_sq, unclipped_sq = dense_sq;
  for (double n : norms) {
    const double kept = n > clip ? n * (clip / (n + 1e-6)) : n;
    clipped_sq += kept * kept;
    unclipped_sq += n * n;
  }
  for (int64_t ep : {1, 2, 4}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    config.parallel.expert_parallel = ep;
    config.training.expert_grad_clip = 0;
    const StepStats unclipped = parallel_trainer(config)->train_step(0);
    EXPECT_NEAR(unclipped.grad_norm, std::sqrt(unclipped_sq), 1e-5 * std::sqrt(unclipped_sq));
    EXPECT_NEAR(unclipped.max_expert_grad_norm, sorted.back(), 1e-5 * sorted.back());
    config.training.expert_grad_clip = clip;
    const StepStats clipped = parallel_trainer(config)->train_step(0);
    EXPECT_NEAR(clipped.max_expert_grad_norm, sorted.back(), 1e-5 * sorted.back());  // before clipping
    // What clipping took off the squared norm: the clipped experts' part, known to ~1e-6.
    const double removed = unclipped_sq - clipped_sq;
    ASSERT_GT(removed, 1e-3 * unclipped_sq);
    EXPECT_NEAR(unclipped.grad_norm * unclipped.grad_norm - clipped.grad_norm * clipped.grad_norm, removed,
                1e-3 * removed);
  }
}

// Zero router weights: uniform scores, so every layer's router entropy is log E per token
// over the global batch; and two evaluations of the same weights read the same sequences.
TEST(ParallelTraining, UniformRouterEntropyAndRepeatableValidation) {
  for (int64_t ep : {1, 2}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    RunConfig config = tiny_config();
    config.parallel.expert_parallel = ep;
    auto trainer = parallel_trainer(config);
    auto& params = trainer->model().params();
    for (int id = 0; id < params.size(); ++id)
      if (params.spec(id).name.find(".router.") != std::string::npos)
        std::fill(params.value(id), params.value(id) + params.numel(id), 0.0f);
    const StepStats stats = trainer->train_step(0);
    ASSERT_EQ(stats.layers.size(), 2u);
    for (const LayerRouting& layer : stats.layers) EXPECT_NEAR(layer.router_entropy, std::log(4.0), 1e-12);
    const double val = trainer->validate();
    EXPECT_EQ(trainer->validate(), val);
  }
}

// Bias balancing over the ranks: after a step every rank's bias moved by the update rate
// towards the mean of the step's global load (dropless: the tokens kept per expert).
TEST(ParallelTraining, BalancingBiasFollowsTheGlobalLoad) {
  for (int64_t ep : {1, 2}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    RunConfig config = tiny_config();
    config.parallel.expert_parallel = ep;
    config.model.moe.bias_balancing = true;
    config.model.moe.bias_update_rate = 0.125;
    auto trainer = parallel_trainer(config);
    const StepStats stats = trainer->train_step(0);
    const auto layers = trainer->model().moe_layers();
    ASSERT_EQ(layers.size(), stats.layers.size());
    int moved = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      int64_t total = 0;
      for (int64_t load : stats.layers[i].tokens_E) total += load;
      EXPECT_EQ(total, config.training.global_batch_tokens * 2);  // top-2
      std::vector<float> want;
      for (int64_t load : stats.layers[i].tokens_E) {
        const int64_t diff = total - 4 * load;  // sign of (mean - load)
        want.push_back(diff > 0 ? 0.125f : diff < 0 ? -0.125f : 0.0f);
        moved += diff != 0;
      }
      EXPECT_EQ(layers[i]->balance_bias_E(), want) << "layer " << i << " on rank " << parallel_world()->rank();
    }
    EXPECT_GT(moved, 0);
  }
}

// moe.temperature_control from the loads summed over the ranks: every rank holds the same
// temperatures at every step, those of the one-process run, and the run matches it.
TEST(ParallelTemperature, TemperatureControlIsTheSameOnEveryRank) {
  for (int64_t ep : {1, 2}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    RunConfig config = tiny_config();
    config.parallel.expert_parallel = ep;
    config.model.moe.temperature_control = true;
    config.model.moe.temperature_gain = 0.5;
    config.metrics.alert_imbalance = 0.0;
    const RunResult got = train_parallel(config);
    std::vector<double> temperatures;
    for (const StepStats& s : got.stats)
      for (const LayerRouting& l : s.layers) temperatures.push_back(l.temperature);
    std::vector<double> rank0 = temperatures;
    parallel_world()->broadcast(rank0.data(), rank0.size(), dist::DType::f64, 0);
    EXPECT_EQ(temperatures, rank0) << "rank " << parallel_world()->rank();
    expect_matches_reference(config, got);
    if (parallel_world()->rank() != 0) continue;
    const RunResult& want = reference(config);
    std::vector<double> expected;
    for (const StepStats& s : want.stats)
      for (const LayerRouting& l : s.layers) expected.push_back(l.temperature);
    const size_t alike = first_routing_difference(got, want) * config.model.n_layers;
    EXPECT_EQ(first_n(temperatures, alike), first_n(expected, alike));
    EXPECT_NE(expected.back(), 1.0);  // it moved
  }
}

// moe.route_cache over ranks: each rank probes its own tokens and the hit counts are summed
// over the ranks, so every rank reports the same hit rates at every step (the first MoE
// layer has no previous layer: -1); the cache only watches, so the run is the one-process
// run's.
TEST(ParallelRouteCache, HitRatesAreTheSameOnEveryRankAndTrainingUnchanged) {
  for (int64_t ep : {1, 2}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    RunConfig config = tiny_config();
    config.parallel.expert_parallel = ep;
    config.model.moe.route_cache = true;
    const RunResult got = train_parallel(config);
    std::vector<double> rates;
    for (const StepStats& s : got.stats)
      for (const LayerRouting& l : s.layers) {
        rates.push_back(l.route_cache_hit_rate);
        rates.push_back(l.route_cache_token_hit_rate);
      }
    std::vector<double> rank0 = rates;
    parallel_world()->broadcast(rank0.data(), rank0.size(), dist::DType::f64, 0);
    EXPECT_EQ(rates, rank0) << "rank " << parallel_world()->rank();
    ASSERT_FALSE(got.stats.empty());
    const auto& last = got.stats.back().layers;
    ASSERT_GE(last.size(), 2u);
    EXPECT_EQ(last.front().route_cache_hit_rate, -1.0);  // no previous MoE layer
    EXPECT_GT(last.back().route_cache_hit_rate, 0.0);
    EXPECT_LE(last.back().route_cache_hit_rate, 1.0);
    expect_matches_reference(config, got);
  }
}

// moe.speculative_dispatch: the guessed rows go before the router, the corrections
// after; the experts see the same rows in the same order, so a run is bit for bit the run
// without it: DP 2 x EP 2 (chunks; fp8 rows with split experts re-placed every 2 steps),
// EP 4 at ZeRO-3 (its parameter gathers in flight beside the early rows), two 2-rank
// worlds, and a resumed run. The counts of rows are the same on every rank, and the runs
// do speculate (used and corrected rows in the second MoE layer).
TEST(ParallelRouteCache, SpeculativeDispatchIsBitForBit) {
  auto& world = *parallel_world();
  struct Case {
    const char* name;
    int64_t ep, chunks;
    bool fp8_split, two_worlds;
  };
  for (const Case& c : {Case{"dp2_ep2", 2, 1, false, false}, Case{"ep4_2_chunks_zero3", 4, 2, false, false},
                        Case{"dp2_ep2_fp8_split_3_chunks", 2, 3, true, false}, Case{"two_worlds_of_ep2", 2, 1, false, true}}) {
    SCOPED_TRACE(c.name);
    RunConfig config = tiny_config();  // 20 steps: the one-process comparison needs a run that learns
    config.parallel.expert_parallel = c.ep;
    config.parallel.a2a_chunks = c.chunks;
    if (c.ep == 4) config.parallel.zero = 3;
    if (c.fp8_split) {
      config.parallel.a2a_compression = A2aCompression::Fp8;
      config.parallel.split_experts = true;
      config.parallel.rebalance_interval = 2;  // the windows the guesses go to move between steps
    }
    config.model.moe.route_cache = true;
    auto run = [&](const RunConfig& cfg) {
      if (!c.two_worlds) return train_parallel(cfg);
      return train(cfg, world.split(world.rank() / 2, world.rank()));  // ranks {0, 1} and {2, 3}
    };
    const RunResult exact = run(config);
    config.model.moe.speculative_dispatch = true;
    const RunResult spec = run(config);
    EXPECT_EQ(spec.loss, exact.loss);
    EXPECT_EQ(spec.aux, exact.aux);
    EXPECT_EQ(spec.grad_norm, exact.grad_norm);
    EXPECT_EQ(spec.params, exact.params);
    EXPECT_EQ(spec.val_loss_end, exact.val_loss_end);
    std::vector<double> counts;
    int64_t used = 0, corrected = 0;
    for (const StepStats& s : spec.stats) {
      ASSERT_EQ(s.layers.size(), 2u);
      EXPECT_EQ(s.layers[0].spec_rows_used, -1);  // nothing guesses the first MoE layer
      EXPECT_GE(s.layers[1].a2a_dispatch_wait_ms, 0);
      used += s.layers[1].spec_rows_used;
      corrected += s.layers[1].spec_rows_corrected;
      for (int64_t v : {s.layers[1].spec_rows_used, s.layers[1].spec_rows_wasted, s.layers[1].spec_rows_corrected})
        counts.push_back(static_cast<double>(v));
    }
    EXPECT_GT(used, 0);
    EXPECT_GT(corrected, 0);
    std::vector<double> rank0 = counts;
    world.broadcast(rank0.data(), rank0.size(), dist::DType::f64, 0);
    if (!c.two_worlds) EXPECT_EQ(counts, rank0) << "rank " << world.rank();
    for (const StepStats& s : exact.stats) EXPECT_EQ(s.layers[1].spec_rows_used, -1);
    if (c.ep == 2 && !c.fp8_split && !c.two_worlds) expect_matches_reference(config, spec);
  }
  // Resumed: checkpoints at step 4 of a speculating run; the resumed run (its routing
  // caches start empty, so other guesses) continues it bit for bit.
  int64_t pid = world.rank() == 0 ? static_cast<int64_t>(getpid()) : 0;
  world.broadcast(&pid, 1, dist::DType::i64, 0);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("moe_mpi_spec_" + std::to_string(pid));
  RunConfig config = tiny_config();
  config.model.vocab_size = 257;  // a config that validates (checkpoints store and re-read it); the task uses 16 ids
  config.training.steps = 8;
  config.parallel.expert_parallel = 2;
  config.model.moe.route_cache = true;
  config.model.moe.speculative_dispatch = true;
  config.checkpoint.dir = dir.string();
  config.checkpoint.interval = 4;
  const RunResult whole = train_parallel(config);
  config.checkpoint.dir = (dir / "resumed").string();
  const RunResult resumed = train_parallel(config, (dir / "step_00000004").string());
  ASSERT_EQ(resumed.loss.size(), 4u);
  EXPECT_EQ(resumed.loss, std::vector<double>(whole.loss.begin() + 4, whole.loss.end()));
  EXPECT_EQ(resumed.params, whole.params);
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

// Run with MOE_RANKS_PER_NODE=2: the EP group of 4 spans two simulated nodes.
TEST(ParallelTrainingHierarchical, FlatAndHierarchicalAgreeAcrossNodes) {
  const dist::LaunchEnv env = dist::read_launch_env();
  if (env.n_nodes < 2) GTEST_SKIP() << "needs MOE_RANKS_PER_NODE=2 (two simulated nodes)";
  RunConfig config = tiny_config();
  config.parallel.expert_parallel = 4;
  config.parallel.a2a_chunks = 2;
  config.parallel.all_to_all = AllToAllKind::Flat;
  const RunResult flat = train_parallel(config);
  config.parallel.all_to_all = AllToAllKind::Hierarchical;
  const RunResult hierarchical = train_parallel(config);
  EXPECT_EQ(flat.loss, hierarchical.loss);
  EXPECT_EQ(flat.params, hierarchical.params);
  expect_matches_reference(config, hierarchical);
  // Rows to the other node: some of what goes to other ranks, the same bytes either way.
  ASSERT_EQ(flat.stats.size(), hierarchical.stats.size());
  for (size_t i = 0; i < flat.stats.size(); ++i) {
    EXPECT_GT(flat.stats[i].a2a_off_node_bytes, 0);
    EXPECT_LT(flat.stats[i].a2a_off_node_bytes, flat.stats[i].a2a_bytes);
    EXPECT_EQ(flat.stats[i].a2a_off_node_bytes, hierarchical.stats[i].a2a_off_node_bytes);
  }
}

}  // namespace
}  // namespace moe
