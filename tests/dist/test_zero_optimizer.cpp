// The CPU's ZeRO-1 (dist::ZeroOptimizer) in the GPU's layout (dist::ZeroShardPlan): one rank
// is AdamW bit for bit; on N ranks (threads over tcp) each rank holds the summed gradients
// of exactly its plan's pieces, the norm ranges count every element once, the steps are
// AdamW's and the gathered moments (what a checkpoint writes) are one process's, byte for
// byte, and a one-process state scattered onto N ranks continues it; ParallelCpuBackend
// plans its block as the GPU backend plans the same model's.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "core/rng.h"
#include "dist/gradient_stages.h"
#include "dist/single_communicator.h"
#include "dist/zero_optimizer.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "tcp_ranks.h"
#include "train/backends/parallel_cpu_backend.h"
#include "odd_sized_model.h"

namespace moe {
namespace {

ParameterStore<float> small_store() {
  ParameterStore<float> params;
  params.add({"lm_head", Shape{5, 3}});
  params.add({"layers.1.norm", Shape{7}, Init::Ones, 0, /*decay=*/false});
  params.add({"layers.0.w", Shape{4, 3}});
  params.add({"embedding", Shape{6, 3}});
  params.allocate(3);
  return params;
}

// One rank: the reduce-scatter is a copy, so the sharded AdamW must be AdamW bit for bit
// (fp32, bf16 and fp8 moments).
TEST(ZeroOptimizer, OneRankIsAdamWBitForBit) {
  for (const MomentDtype state_dtype : {MomentDtype::Fp32, MomentDtype::Bf16, MomentDtype::Fp8}) {
    SCOPED_TRACE(name_of(state_dtype));
    ParameterStore<float> sharded = small_store(), plain = small_store();
    auto stage = [&](const std::string& name) {
      return name == "lm_head" ? 0 : name == "layers.1.norm" ? 1 : name == "layers.0.w" ? 2 : 3;
    };
    auto world = dist::make_single_communicator();
    dist::CommStats stats;
    OptimizerConfig config;
    config.state_dtype = state_dtype;
    dist::ZeroOptimizer zero(sharded, dist::plan_zero_for_store(sharded, stage, 4, {}, {}, /*bucket_mb=*/0, 1, 0),
                             *world, config, stats);
    for (int s = 0; s < 4; ++s) EXPECT_EQ(zero.plan().sharded[static_cast<size_t>(s)].size(), 1u);  // one per stage
    EXPECT_EQ(zero.ids(), (std::vector<int>{0, 1, 2, 3}));
    AdamW adamw(config, plain);
    const CounterRng rng(9, "grads");
    for (int step = 0; step < 3; ++step) {
      for (auto* store : {&sharded, &plain})
        for (int id = 0; id < store->size(); ++id)
          for (int64_t i = 0; i < store->numel(id); ++i)
            store->grad(id)[i] = static_cast<float>(rng.normal(static_cast<uint64_t>(step * 1000 + id * 100 + i)));
      zero.arm();
      for (int s = 0; s < 4; ++s) zero.on_stage(s);
      zero.finish();
      zero.step(1e-2);
      adamw.step(1e-2);
    }
    size_t differ = 0;
    for (int id = 0; id < plain.size(); ++id)
      for (int64_t i = 0; i < plain.numel(id); ++i) differ += sharded.value(id)[i] != plain.value(id)[i];
    EXPECT_EQ(differ, 0u);
    EXPECT_GT(stats.grad_sync_s, 0);
  }
}

std::vector<int> router_biases(const ParameterStore<float>& params) {
  std::vector<int> ids;
  for (int id = 0; id < params.size(); ++id)
    if (params.spec(id).name.ends_with(".moe.router.bias")) ids.push_back(id);
  return ids;
}

// Rank r's gradient of block element x at a step: sixteenths, so that every sum over the
// ranks (and of squares) is exact in any order and the ranks' AdamW must be one process's.
float rank_grad(int step, int rank, int64_t x) {
  return static_cast<float>((x * 7 + rank * 13 + step * 5) % 17 - 8) / 16.0f;
}

// Fills the parameters' gradients (not the padding) with rank_grad summed over `ranks`
// ranks (ranks = 1: rank `rank`'s alone).
void fill_grads(ParameterStore<float>& params, int step, int rank, int ranks) {
  for (int id = 0; id < params.size(); ++id)
    for (int64_t i = 0; i < params.numel(id); ++i) {
      const int64_t x = params.offset(id) + i;
      float g = 0;
      if (ranks == 1) g = rank_grad(step, rank, x);
      else
        for (int r = 0; r < ranks; ++r) g += rank_grad(step, r, x);
      params.grad(id)[i] = g;
    }
}

size_t count_differences(const ParameterStore<float>& a, const ParameterStore<float>& b) {
  size_t differ = 0;
  for (int id = 0; id < a.size(); ++id)
    for (int64_t i = 0; i < a.numel(id); ++i) differ += a.value(id)[i] != b.value(id)[i];
  return differ;
}

bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

constexpr double kBucketMb = 0.002;  // 448-element buckets: several per stage

// Three steps of `zero` on this rank of `ranks` (`model`'s parameters, each rank its own
// gradients) against one process's AdamW over the summed gradients (`alone`): after each
// step's sums this rank holds exactly the sums of its plan's update ranges (and less than
// the block), the ranks' norm ranges count every element once, and the weights are the
// one process's bit for bit.
void expect_steps_like_one_process(Transformer<float>& model, Transformer<float>& alone, dist::ZeroOptimizer& zero,
                                   AdamW& adamw, dist::Communicator& world, int rank, int ranks) {
  auto& params = model.params();
  for (int step = 0; step < 3; ++step) {
    fill_grads(params, step, rank, 1);
    fill_grads(alone.params(), step, 0, ranks);
    zero.arm();
    for (int s = 0; s < model.backward_stages(); ++s) zero.on_stage(s);
    zero.finish();
    size_t wrong = 0, held = 0;
    const float* sums = alone.params().grads_data();
    for (const auto& [begin, count] : zero.plan().update)
      for (int64_t x = begin; x < begin + count; ++x, ++held) wrong += params.grads_data()[x] != sums[x];
    EXPECT_EQ(wrong, 0u) << "rank " << rank << " step " << step;
    EXPECT_LT(held, static_cast<size_t>(params.storage_numel()));  // a shard, not the block
    double sq = zero.shard_sum_of_squares();
    world.all_reduce(&sq, 1, dist::DType::f64);
    double want = 0;
    for (int64_t x = 0; x < params.storage_numel(); ++x) want += double(sums[x]) * sums[x];
    EXPECT_EQ(sq, want);
    zero.step(1e-2);
    adamw.step(1e-2);
    EXPECT_EQ(count_differences(params, alone.params()), 0u) << "rank " << rank << " step " << step;
  }
}

// fp8 moments too: a rank's pieces start on multiples of 16, so its blocks are one process's.
TEST(ZeroOptimizer, RanksHoldThePlansPiecesAndReproduceAdamW) {
  constexpr int kRanks = 3;
  for (const MomentDtype moments : {MomentDtype::Fp32, MomentDtype::Fp8}) {
  SCOPED_TRACE(name_of(moments));
  dist::run_tcp_ranks(kRanks, [moments](std::unique_ptr<dist::Communicator>& world, int rank) {
    Transformer<float> model(test::odd_sized_model(), 1), alone(test::odd_sized_model(), 1);
    auto& params = model.params();
    const auto stage_of = [&](const std::string& name) { return model.backward_stage_of(name); };
    dist::CommStats stats;
    OptimizerConfig config;
    config.state_dtype = moments;
    dist::ZeroOptimizer zero(params,
                             dist::plan_zero_for_store(params, stage_of, model.backward_stages(), router_biases(params),
                                                       {}, kBucketMb, kRanks, rank),
                             *world, config, stats);
    const dist::ZeroShardPlan& plan = zero.plan();
    ASSERT_GT(plan.update.size(), 1u);
    AdamW adamw(config, alone.params());
    expect_steps_like_one_process(model, alone, zero, adamw, *world, rank, kRanks);
    // A checkpoint's moments gathered from the ranks: one process's, byte for byte.
    std::vector<float> m(adamw.first_moment().size(), -1.0f), v(m.size(), -1.0f);
    zero.gather_moments([&](int id) { return adamw.moment_offset(id); }, m, v);
    EXPECT_TRUE(same_bytes(m, adamw.first_moment()));
    EXPECT_TRUE(same_bytes(v, adamw.second_moment()));
  });
  }
}

// The GPU's plan with gate|up interleaved (plan_zero_shards with the MoE layers' w1 | w3 as
// pairs: buckets cut at expert slices, whole slices a piece where 3 of them fit a bucket) is
// a ZeRO plan as any: on 3 ranks each holds the sums of its pieces, the norm ranges count
// every element once and the steps are one process's AdamW, bit for bit. Bucket sizes for
// both cuts: 448 elements (each 240-element slice bucketed alone) and 4,992 (experts 0-2 of
// w1 and of w3 one bucket each, expert 3 alone).
TEST(ZeroOptimizer, ExpertSliceCutsForInterleavedGateUpReproduceAdamW) {
  constexpr int kRanks = 3;
  for (const double bucket_mb : {kBucketMb, 0.02}) {
    SCOPED_TRACE(testing::Message() << "buckets of " << bucket_mb << " MB");
    dist::run_tcp_ranks(kRanks, [bucket_mb](std::unique_ptr<dist::Communicator>& world, int rank) {
      Transformer<float> model(test::odd_sized_model(), 1), alone(test::odd_sized_model(), 1);
      auto& params = model.params();
      std::vector<HiInterleave> pairs;
      RangeList keep;
      for (int id = 0; id < params.size(); ++id) {
        const std::string& name = params.spec(id).name;
        if (name.ends_with(".moe.experts.w1")) pairs.push_back({params.offset(id), 4, params.numel(id) / 4});
        if (name.ends_with(".moe.router.bias")) keep.emplace_back(params.offset(id), (params.numel(id) + 15) / 16 * 16);
      }
      ASSERT_EQ(pairs.size(), 2u);
      const auto stages = dist::gradient_ranges_by_stage(
          params, [&](const std::string& name) { return model.backward_stage_of(name); }, model.backward_stages());
      dist::ZeroShardPlan plan = dist::plan_zero_shards(
          stages, keep, dist::gradient_bucket_elems(bucket_mb, params.storage_numel()), kRanks, rank, pairs);
      // Whole-slice groups gather w1's and w3's slices as one range; with each slice a bucket
      // of its own the gathers are the same ranges as the buckets (the slices swap places).
      if (bucket_mb > kBucketMb) ASSERT_NE(plan.weight_gathers, plan.sharded);
      else ASSERT_EQ(plan.weight_gathers, plan.sharded);
      dist::CommStats stats;
      const OptimizerConfig config;
      dist::ZeroOptimizer zero(params, std::move(plan), *world, config, stats);
      AdamW adamw(config, alone.params());
      expect_steps_like_one_process(model, alone, zero, adamw, *world, rank, kRanks);
    });
  }
}

// Resuming on another rank count: one process's AdamW state scattered onto N ranks steps
// on as that process, and gathers back to it.
TEST(ZeroOptimizer, OneProcessStateScatteredOntoRanksContinuesIt) {
  constexpr int kRanks = 3;
  dist::run_tcp_ranks(kRanks, [](std::unique_ptr<dist::Communicator>& world, int rank) {
    Transformer<float> alone(test::odd_sized_model(), 1);
    const OptimizerConfig config;
    AdamW adamw(config, alone.params());
    for (int step = 0; step < 2; ++step) {
      fill_grads(alone.params(), step, 0, kRanks);
      adamw.step(1e-2);
    }
    Transformer<float> model(test::odd_sized_model(), 1);
    auto& params = model.params();
    std::memcpy(params.values_data(), alone.params().values_data(), static_cast<size_t>(params.storage_numel()) * 4);
    dist::CommStats stats;
    dist::ZeroOptimizer zero(params,
                             dist::plan_zero_for_store(
                                 params, [&](const std::string& name) { return model.backward_stage_of(name); },
                                 model.backward_stages(), router_biases(params), {}, kBucketMb, kRanks, rank),
                             *world, config, stats);
    const auto offset = [&](int id) { return adamw.moment_offset(id); };
    zero.scatter_moments(offset, adamw.first_moment(), adamw.second_moment());
    zero.set_steps_taken(adamw.steps_taken());
    fill_grads(params, 2, rank, 1);
    fill_grads(alone.params(), 2, 0, kRanks);
    zero.arm();
    for (int s = 0; s < model.backward_stages(); ++s) zero.on_stage(s);
    zero.finish();
    zero.step(1e-2);
    adamw.step(1e-2);
    EXPECT_EQ(count_differences(params, alone.params()), 0u) << "rank " << rank;
    std::vector<float> m(adamw.first_moment().size()), v(m.size());
    zero.gather_moments(offset, m, v);
    EXPECT_TRUE(same_bytes(m, adamw.first_moment()));
    EXPECT_TRUE(same_bytes(v, adamw.second_moment()));
  });
}

// One layout for both paths: the CPU backend's plan on each rank is the one the GPU
// backend makes for the same model and ranks (GpuBackend::make_data_parallel in
// src/train/backends/cuda/gpu_backend.cpp): the block's stage ranges, the fp32 copies'
// ranges (the router biases, each padded to 16: GpuFp32Copies::ranges)
// kept whole, buckets of GpuDataParallel's bucket_elems.
TEST(ZeroOptimizer, CpuBackendShardsAsTheGpuBackend) {
  constexpr int kRanks = 2;
  for (double bucket_mb : {0.0, kBucketMb}) {
    SCOPED_TRACE("bucket_mb " + std::to_string(bucket_mb));
    dist::run_tcp_ranks(kRanks, [&](std::unique_ptr<dist::Communicator>& world, int rank) {
      RunConfig config;
      config.model = test::odd_sized_model();
      config.parallel.bucket_mb = bucket_mb;
      HostState host;
      host.model = std::make_unique<Transformer<float>>(config.model, 1);
      host.optimizer = std::make_unique<AdamW>(config.optimizer, host.model->params());
      ParallelCpuBackend backend(config, std::move(host), std::move(world));
      Transformer<float>& model = backend.host_model();
      const auto& params = model.params();
      RangeList fp32_copies;
      for (int id : router_biases(params)) fp32_copies.emplace_back(params.offset(id), (params.numel(id) + 15) / 16 * 16);
      ASSERT_EQ(fp32_copies.size(), 2u);  // two MoE layers
      const dist::ZeroShardPlan gpu = dist::plan_zero_shards(
          dist::gradient_ranges_by_stage(
              params, [&](const std::string& name) { return model.backward_stage_of(name); }, model.backward_stages()),
          fp32_copies, dist::gradient_bucket_elems(bucket_mb, params.storage_numel()), kRanks, rank);
      const dist::ZeroShardPlan& cpu = backend.zero().plan();
      EXPECT_EQ(cpu.ranks, kRanks);
      EXPECT_EQ(cpu.rank, rank);
      EXPECT_EQ(cpu.sharded, gpu.sharded);
      EXPECT_EQ(cpu.replicated, gpu.replicated);
      EXPECT_EQ(cpu.update, gpu.update);
      EXPECT_EQ(cpu.norm, gpu.norm);
      EXPECT_EQ(backend.zero().ids().size(), static_cast<size_t>(params.size()));  // expert_parallel 1: everything
    });
  }
}

// GpuDataParallel's bucket sizes (now this function): 64-element multiples, at least 64,
// at most the block; 0 MB the whole block.
TEST(ZeroOptimizer, GradientBucketElements) {
  EXPECT_EQ(dist::gradient_bucket_elems(0, 1000), 1000);
  EXPECT_EQ(dist::gradient_bucket_elems(0.002, 100000), 448);  // 500 elements, down to 64s
  EXPECT_EQ(dist::gradient_bucket_elems(1e-9, 100000), 64);
  EXPECT_EQ(dist::gradient_bucket_elems(25, 1000), 1000);
  EXPECT_EQ(dist::gradient_bucket_elems(25, 40), 40);
  EXPECT_THROW(dist::gradient_bucket_elems(-1, 1000), Error);
}

}  // namespace
}  // namespace moe
