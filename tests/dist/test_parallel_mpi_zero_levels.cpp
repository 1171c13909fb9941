// ZeRO levels 0-3 on CPU ranks (label mpi: 4 ranks under mpirun and over tcp). Every
// layout, EP 1/2/4 x ZeRO 0-3, gives the one-process run's losses and weights (the
// tolerances of test_parallel_mpi_training.cpp); levels that must agree bit for bit do;
// checkpoints reshard across levels; and levels 2 and 3 really give the memory back.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "optim/adamw.h"
#include "parallel_training.h"
#include "train/backends/parallel_cpu_backend.h"

namespace moe {
namespace {

using namespace test_parallel;

// tiny_config over EP ep and ZeRO zero, with `micro_batches` micro-batches per step and
// buckets of 500 elements (several per stage, ragged tails replicated).
RunConfig zero_config(int64_t ep, int64_t zero, int64_t micro_batches, int64_t steps = 20) {
  RunConfig config = tiny_config();
  config.training.steps = steps;
  config.training.global_batch_tokens = parallel_world()->size() * config.model.seq_len * micro_batches;
  config.parallel.expert_parallel = ep;
  config.parallel.zero = zero;
  config.parallel.bucket_mb = 0.002;
  return config;
}

// Every level over every EP size follows one process. Level 3 gathers the very values
// level 2 steps, so the two agree bit for bit; with several micro-batches levels 2-3 sum
// each micro-batch over the ranks (levels 0-1: the step's sum), so they differ from 0-1
// only in the order of sums.
TEST(ParallelZeroLevels, EveryLayoutMatchesOneProcess) {
  for (int64_t ep : {1, 2, 4}) {
    std::vector<RunResult> runs;
    for (int64_t zero : {0, 1, 2, 3}) {
      SCOPED_TRACE("expert_parallel " + std::to_string(ep) + ", zero " + std::to_string(zero));
      const RunConfig config = zero_config(ep, zero, 2);
      runs.push_back(train_parallel(config));
      expect_matches_reference(config, runs.back());
    }
    EXPECT_EQ(runs[3].loss, runs[2].loss) << "EP " << ep;
    EXPECT_EQ(runs[3].params, runs[2].params) << "EP " << ep;
  }
}

// With one micro-batch per step levels 1, 2 and 3 reduce the same buckets once and step
// the same pieces: bit for bit the same run. (ep 0: EP 1 with a tied head, whose stage 0
// reads the embedding's values too.)
TEST(ParallelZeroLevels, LevelsOneToThreeAgreeBitForBitOnOneMicroBatch) {
  for (int64_t ep : {1, 2, 0}) {
    SCOPED_TRACE("expert_parallel " + std::to_string(ep));
    auto config = [&](int64_t zero) {
      RunConfig c = zero_config(std::max<int64_t>(ep, 1), zero, 1, 6);
      c.model.tie_embeddings = ep == 0;
      return c;
    };
    const RunResult one = train_parallel(config(1));
    for (int64_t zero : {2, 3}) {
      const RunResult got = train_parallel(config(zero));
      EXPECT_EQ(got.loss, one.loss) << "zero " << zero;
      EXPECT_EQ(got.grad_norm, one.grad_norm) << "zero " << zero;
      EXPECT_EQ(got.params, one.params) << "zero " << zero;
    }
  }
}

// Experts at ZeRO 1-3 over their replicas (EP 2 over 4 ranks: each expert on two ranks):
// each replica keeps the moments of half of its experts' elements; with one micro-batch
// per step the runs follow ZeRO 0 bit for bit without clipping (the same sums: two ranks'
// gradients, each element stepped once) and up to the order of the norm's sums with it,
// where levels 1-3 agree bit for bit (each share's squares counted once, each share scaled
// alike). (Without clipping levels 1-3 agree bit for bit: LevelsOneToThree...)
TEST(ParallelZeroLevels, ExpertsShardOverTheReplicasAtLevelsOneToThree) {
  auto& world = *parallel_world();
  ASSERT_EQ(world.size(), 4);
  auto moment_elements = [&](int64_t zero) {
    RunConfig config = zero_config(2, zero, 2);
    HostState host;
    host.model = std::make_unique<Transformer<float>>(config.model, 1);
    host.optimizer = std::make_unique<AdamW>(config.optimizer, host.model->params());
    ParallelCpuBackend backend(config, std::move(host), world.split(0, world.rank()));
    return backend.experts()->moment_elements();
  };
  // 2 MoE layers x 2 experts per EP rank x (3 tensors of 32 x 32) x 2 moments, whole.
  EXPECT_EQ(moment_elements(0), 2 * 2 * 3 * 32 * 32 * 2);
  for (int64_t zero : {1, 2, 3}) EXPECT_EQ(moment_elements(zero), 2 * 2 * 3 * 32 * 32 * 2 / 2) << "zero " << zero;
  for (bool clip : {false, true}) {
    SCOPED_TRACE(clip ? "clipped" : "not clipped");
    std::vector<RunResult> runs;
    for (int64_t zero = 0; zero <= (clip ? 3 : 1); ++zero) {
      SCOPED_TRACE("zero " + std::to_string(zero));
      RunConfig config = zero_config(2, zero, 1);
      config.training.grad_clip = clip ? 0.05 : 0.0;
      config.training.expert_grad_clip = clip ? 0.02 : 0.0;
      runs.push_back(train_parallel(config));
      expect_matches_reference(config, runs.back());
    }
    if (!clip) {
      EXPECT_EQ(runs[1].loss, runs[0].loss);
      EXPECT_EQ(runs[1].params, runs[0].params);
    }
    expect_close(runs[1].grad_norm, runs[0].grad_norm, 1e-9, "gradient norm at ZeRO 1 against ZeRO 0");
    for (size_t zero = 2; zero < runs.size(); ++zero) {
      EXPECT_EQ(runs[zero].grad_norm, runs[1].grad_norm) << "zero " << zero;
      EXPECT_EQ(runs[zero].loss, runs[1].loss) << "zero " << zero;
      EXPECT_EQ(runs[zero].params, runs[1].params) << "zero " << zero;
    }
  }
}

// Sharded expert state moves with the experts: EP 2 over 4 ranks at ZeRO 1-3 with split
// experts re-placed every step (unequal counts), saved after step 4 (each replica its
// share of the moments, at level 3 of the weights too) and resumed on the same ranks,
// continues bit for bit; level 3 is level 2 bit for bit (ResumeReshardsAcrossLevels
// reshards such a save; ExpertsShardOverTheReplicas... compares with one process).
TEST(ParallelZeroLevels, ShardedExpertsMoveAndResume) {
  RunResult level_two;
  for (int64_t zero : {1, 2, 3}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    RunConfig config = zero_config(2, zero, 2, 8);
    config.model.vocab_size = 257;
    config.parallel.rebalance_interval = 1;
    config.parallel.rebalance_max_experts = 3;
    config.parallel.split_experts = true;
    const std::filesystem::path dir = shared_dir("zero_sharded_experts_" + std::to_string(zero));
    config.checkpoint.dir = (dir / "whole").string();
    config.checkpoint.interval = 4;
    const RunResult whole = train_parallel(config);
    config.checkpoint.dir = (dir / "resumed").string();
    const RunResult resumed = train_parallel(config, (dir / "whole" / "step_00000004").string());
    EXPECT_EQ(resumed.loss, std::vector<double>(whole.loss.begin() + 4, whole.loss.end()));
    EXPECT_EQ(resumed.params, whole.params);
    if (zero == 2) level_two = whole;
    if (zero == 3) {
      EXPECT_EQ(whole.loss, level_two.loss);
      EXPECT_EQ(whole.params, level_two.params);
    }
    remove_shared_dir(dir);
  }
}

// The share of the pages of [data, data + n) the process holds in memory (mincore).
double resident_share(const float* data, int64_t n) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data + n) / page * page;
  if (end <= begin) return 0;
  std::vector<unsigned char> in_memory((end - begin) / page);
  EXPECT_EQ(mincore(reinterpret_cast<void*>(begin), end - begin, in_memory.data()), 0);
  size_t resident = 0;
  for (unsigned char page_in : in_memory) resident += page_in & 1;
  return static_cast<double>(resident) / static_cast<double>(in_memory.size());
}

// After steps of 2 micro-batches, a rank of 4 holds about a quarter of the gradient pages
// from level 2 and of the parameter pages at level 3 (its pieces, the replicated router
// biases and the pages its pieces share with others'); below, all of them. Experts of
// 128 x 256 so that the pieces span many pages.
TEST(ParallelZeroLevels, LevelsTwoAndThreeGiveTheMemoryBack) {
  for (int64_t zero : {1, 2, 3}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    RunConfig config = zero_config(1, zero, 2, 2);
    config.model.dim = 128;
    config.model.moe.expert_hidden = 256;
    config.parallel.bucket_mb = 0;  // a bucket per stage
    const auto trainer = parallel_trainer(config);
    trainer->train_step(0);
    trainer->train_step(1);
    auto& params = trainer->model().params();
    const double grads = resident_share(params.grads_data(), params.storage_numel());
    const double values = resident_share(params.values_data(), params.storage_numel());
    if (zero >= 2) EXPECT_LT(grads, 0.3);
    else EXPECT_GT(grads, 0.95);
    if (zero == 3) EXPECT_LT(values, 0.3);
    else EXPECT_GT(values, 0.95);
  }
}

// Experts at levels 2 and 3 keep their own share only: EP 2 over 4 ranks without split
// experts (the window is the rank's own experts, each on two replicas), after steps of 2
// micro-batches a rank holds about half of its window's gradient pages from level 2 and of
// its weight pages at level 3; below, all of them. Experts of 128 x 256 so that a share
// spans many pages.
TEST(ParallelZeroLevels, ExpertsAtLevelsTwoAndThreeGiveTheirMemoryBack) {
  auto& world = *parallel_world();
  ASSERT_EQ(world.size(), 4);
  for (int64_t zero : {1, 2, 3}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    RunConfig config = zero_config(2, zero, 2, 2);
    config.model.dim = 128;
    config.model.moe.expert_hidden = 256;
    const auto trainer = parallel_trainer(config);
    trainer->train_step(0);
    trainer->train_step(1);
    auto& params = trainer->model().params();
    // EP rank rank % 2 holds experts 2 p and 2 p + 1 of each MoE layer: consecutive.
    const int64_t first = 2 * (world.rank() % 2);
    double grads = 0, values = 0;
    int tensors = 0;
    for (int id = 0; id < params.size(); ++id) {
      if (params.spec(id).expert_group.empty()) continue;
      const int64_t per_expert = params.numel(id) / params.spec(id).shape[0];
      grads += resident_share(params.grad(id) + first * per_expert, 2 * per_expert);
      values += resident_share(params.value(id) + first * per_expert, 2 * per_expert);
      ++tensors;
    }
    ASSERT_EQ(tensors, 2 * 3);
    grads /= tensors;
    values /= tensors;
    if (zero >= 2) EXPECT_LT(grads, 0.6);
    else EXPECT_GT(grads, 0.95);
    if (zero == 3) EXPECT_LT(values, 0.6);
    else EXPECT_GT(values, 0.95);
  }
}

struct Layout {
  int64_t ep, zero;
};

// Resuming reshards across ZeRO levels: 8 steps at 4 ranks saved after step 4, resumed at
// 2 ranks in another level (which save the state they resumed before training on) and at
// one process, both following the uninterrupted run up to the order of sums; and back at
// 4 ranks from the 2 ranks' save, bit for bit (the layout that trained).
TEST(ParallelZeroLevels, ResumeReshardsAcrossLevels) {
  auto& world = *parallel_world();
  ASSERT_EQ(world.size(), 4);
  for (const auto& [four, two] : {std::pair{Layout{4, 2}, Layout{2, 3}}, std::pair{Layout{1, 3}, Layout{2, 0}},
                                  std::pair{Layout{2, 0}, Layout{1, 2}}, std::pair{Layout{2, 1}, Layout{1, 1}}}) {
    const std::string name = "EP" + std::to_string(four.ep) + "_Z" + std::to_string(four.zero);
    SCOPED_TRACE(name + " -> EP " + std::to_string(two.ep) + " ZeRO " + std::to_string(two.zero));
    const std::filesystem::path dir = shared_dir("zero_reshard_" + name);
    RunConfig config = zero_config(four.ep, four.zero, 2, 8);
    config.model.vocab_size = 257;  // a config that validates (checkpoints store and re-read it)
    config.checkpoint.dir = (dir / "ranks_4").string();
    config.checkpoint.interval = 4;
    const RunResult whole = train_parallel(config);
    const std::filesystem::path saved = dir / "ranks_4" / "step_00000004";
    ASSERT_TRUE(std::filesystem::exists(saved / "COMPLETE"));
    const std::vector<double> rest(whole.loss.begin() + 4, whole.loss.end());
    const int color = world.rank() < 2 ? 0 : world.rank();
    std::unique_ptr<dist::Communicator> group = world.split(color, world.rank());
    if (color < 3) {
      RunConfig fewer = config;
      fewer.training.micro_batch *= world.size() / group->size();  // the same global micro-batch
      fewer.parallel.expert_parallel = two.ep;
      fewer.parallel.zero = two.zero;
      if (group->size() == 1) fewer.parallel = ParallelConfig{};
      fewer.checkpoint.dir = (dir / ("fewer_" + std::to_string(color))).string();
      fewer.checkpoint.interval = 0;
      const auto trainer = make_trainer(fewer, std::move(group));
      std::ostringstream log;
      trainer->resume(saved.string(), log);
      if (color == 0) trainer->save_checkpoint(log);
      std::vector<double> losses;
      trainer->on_step = [&](const StepStats& s) { losses.push_back(s.loss); };
      trainer->run(log);
      if (world.rank() == 0 || world.rank() == 2)
        expect_close(losses, rest, 1e-5, color == 0 ? "2 ranks resuming 4 ranks' checkpoint" : "one process resuming");
    }
    world.barrier();
    RunConfig back = config;
    back.checkpoint.dir = (dir / "back").string();
    const RunResult resumed = train_parallel(back, (dir / "fewer_0" / "step_00000004").string());
    EXPECT_EQ(resumed.loss, rest);
    EXPECT_EQ(resumed.params, whole.params);
    remove_shared_dir(dir);
  }
}

// Resharding between every pair of layouts, without training between: the state one
// step of 2 micro-batches leaves at each of the 12 four-rank layouts (EP 1/2/4 x ZeRO 0-3;
// moments not zero), resumed by a fresh trainer at each of the 12, at 2 ranks EP 1 and
// EP 2 (their ZeRO level turning with the source, so that all 8 two-rank layouts occur)
// and at one process, and saved again, is the saved state tensor by tensor, bit for bit.
// Each layout writes its own pieces (ZeRO-3 the parameters' too, ZeRO-0 replicated
// moments, EP the blocks' experts and at levels 1-3 the replicas' shares) and reads only
// what it holds.
TEST(ParallelZeroLevels, CheckpointsReshardBetweenEveryPairOfLayouts) {
  auto& world = *parallel_world();
  ASSERT_EQ(world.size(), 4);
  std::vector<Layout> layouts;
  for (int64_t ep : {1, 2, 4})
    for (int64_t zero : {0, 1, 2, 3}) layouts.push_back({ep, zero});
  auto name = [](Layout l) { return "EP" + std::to_string(l.ep) + "_Z" + std::to_string(l.zero); };
  // Layout l over `ranks` ranks, the same global micro-batch.
  auto config_at = [&](Layout l, int ranks) {
    RunConfig config = zero_config(l.ep, l.zero, 2, 1);
    config.model.vocab_size = 257;  // a config that validates (checkpoints store and re-read it)
    config.training.micro_batch *= world.size() / ranks;
    config.parallel.bucket_mb = 0;  // a bucket per stage: fewer pieces, shorter manifests
    if (ranks == 1) config.parallel = ParallelConfig{};
    return config;
  };
  const std::filesystem::path dir = shared_dir("zero_every_pair", /*in_memory=*/true);
  for (const Layout& l : layouts) {
    RunConfig config = config_at(l, 4);
    config.checkpoint.dir = (dir / name(l)).string();
    config.checkpoint.interval = 1;
    train_parallel(config);
  }
  int compared = 0;
  for (size_t a = 0; a < layouts.size(); ++a) {
    const std::filesystem::path saved = dir / name(layouts[a]) / "step_00000001";
    const auto want = world.rank() == 0 ? saved_tensors(saved) : std::map<std::string, std::vector<float>>{};
    // Resumes `saved` at `config` over `group` and saves into dir / into.
    auto resave = [&](RunConfig config, std::unique_ptr<dist::Communicator> group, const std::string& into) {
      config.checkpoint.dir = (dir / into).string();
      const auto trainer = make_trainer(config, std::move(group));
      std::ostringstream log;
      trainer->resume(saved.string(), log);
      trainer->save_checkpoint(log);
    };
    auto expect_same = [&](const std::string& into, const std::string& what) {
      world.barrier();
      if (world.rank() != 0) return;
      SCOPED_TRACE(name(layouts[a]) + " resumed at " + what);
      const auto got = saved_tensors(dir / into / "step_00000001");
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [tensor, values] : want) EXPECT_TRUE(got.at(tensor) == values) << tensor;
      ++compared;
    };
    for (const Layout& b : layouts) {
      resave(config_at(b, 4), world.split(0, world.rank()), "ranks_4");
      expect_same("ranks_4", "4 ranks " + name(b));
    }
    // Ranks 0-1: 2 ranks EP 1, ranks 2-3: 2 ranks EP 2; then rank 0 alone.
    const int color = world.rank() / 2;
    const Layout two{color + 1, static_cast<int64_t>(a + color) % 4};
    resave(config_at(two, 2), world.split(color, world.rank()), "ranks_2_" + std::to_string(color));
    for (int c : {0, 1}) expect_same("ranks_2_" + std::to_string(c), "2 ranks EP " + std::to_string(c + 1));
    std::unique_ptr<dist::Communicator> alone = world.split(world.rank() == 0 ? 0 : 1, world.rank());
    if (world.rank() == 0) resave(config_at({1, 0}, 1), std::move(alone), "ranks_1");
    expect_same("ranks_1", "one process");
  }
  if (world.rank() == 0) EXPECT_EQ(compared, 12 * (12 + 2 + 1));
  remove_shared_dir(dir);
}

}  // namespace
}  // namespace moe
