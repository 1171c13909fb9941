// GPU expert parallelism over two ranks on one GPU: two models in two threads, their
// exchanges and broadcasts done by device copies between them (PairExchange). So the
// multi-rank paths run without a second GPU: rows to the other rank and back, unequal
// expert counts after a re-placement, and the broadcast of the experts that change ranks.
// - EP 2 against one GPU on both micro-batches: the same losses and gradients (the shared
//   gradients as the mean of the two ranks', each expert's from the rank computing it);
// - EP 2 with every MoE layer re-placed after an AdamW step (one rank holding a single
//   expert, or none; the copies of the experts changing ranks are stale until sent): with
//   top-1 the very same bits as EP 2 in equal blocks, with top-2 close (a token's partial
//   combines then split differently over the ranks).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <memory>
#include <thread>

#include "dist/gradient_stages.h"
#include "gpu_test_util.h"
#include "small_models.h"
#include "model/cuda/gpu_parameter_io.h"
#include "model/cuda/gpu_transformer.h"
#include "model/transformer.h"
#include "optim/cuda/gpu_optimizer.h"

namespace moe {
namespace {

// What both ranks see: each posts its buffers, a barrier, then each copies its part.
struct PairShared {
  std::barrier<> sync{2};
  struct Posted {
    const void* send = nullptr;
    void* recv = nullptr;
    std::vector<int64_t> recv_counts;
    const float* grads = nullptr;  // split experts: the host copy of the rank's gradients
  };
  std::array<Posted, 2> posted;
};

class PairExchange final : public GpuExpertExchange {
 public:
  PairExchange(PairShared& shared, int rank) : shared_(shared), rank_(rank) {}
  int size() const override { return 2; }
  int rank() const override { return rank_; }
  void set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }
  void exchange(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                const std::vector<int64_t>& recv_counts, size_t elem_bytes) override {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);  // `send` is written
    shared_.posted[static_cast<size_t>(rank_)] = {send, recv, recv_counts};
    shared_.sync.arrive_and_wait();
    int64_t sent = 0;
    for (int peer = 0; peer < 2; ++peer) {
      const PairShared::Posted& to = shared_.posted[static_cast<size_t>(peer)];
      EXPECT_EQ(send_counts[static_cast<size_t>(peer)], to.recv_counts[static_cast<size_t>(rank_)]);
      int64_t at = 0;  // our block in the peer's received layout comes after lower sources'
      for (int source = 0; source < rank_; ++source) at += to.recv_counts[static_cast<size_t>(source)];
      const int64_t n = send_counts[static_cast<size_t>(peer)];
      if (n > 0)
        EXPECT_EQ(cudaMemcpyAsync(static_cast<char*>(to.recv) + at * elem_bytes,
                                  static_cast<const char*>(send) + sent * elem_bytes, n * elem_bytes,
                                  cudaMemcpyDeviceToDevice, stream_),
                  cudaSuccess);
      sent += n;
    }
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    bytes += sent * static_cast<int64_t>(elem_bytes);
    shared_.sync.arrive_and_wait();  // both ranks' rows have arrived
  }
  void broadcast(void* data, size_t bytes_n, int root) override {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    shared_.posted[static_cast<size_t>(rank_)].recv = data;
    shared_.sync.arrive_and_wait();
    if (rank_ != root)
      EXPECT_EQ(cudaMemcpyAsync(data, shared_.posted[static_cast<size_t>(root)].recv, bytes_n,
                                cudaMemcpyDeviceToDevice, stream_),
                cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    ++broadcasts;
    shared_.sync.arrive_and_wait();
  }
  int64_t bytes = 0;
  int broadcasts = 0;

 private:
  PairShared& shared_;
  int rank_;
  cudaStream_t stream_ = nullptr;
};

ModelConfig pair_config(double capacity_factor) {
  ModelConfig c = test::small_moe_model(capacity_factor);
  // The aux and z losses are over a rank's own micro-batch: off, to compare with one GPU.
  c.moe.aux_loss_coef = 0;
  c.moe.z_loss_coef = 0;
  return c;
}

std::vector<int32_t> tokens(const ModelConfig& c, int64_t sequences, uint64_t seed, int lane) {
  CounterRng rng(seed, "pair");
  std::vector<int32_t> out;
  for (int64_t i = 0; i < sequences * c.seq_len; ++i)
    out.push_back(static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[lane] % c.vocab_size));
  return out;
}

struct RankRun {
  ForwardResult loss, second_loss;
  std::vector<float> grads, second_grads;
  std::vector<std::vector<int64_t>> load;
  std::vector<float> values, m, v;  // after a second AdamW step, every expert gathered from its rank
  std::vector<float> held;  // the same weights before the gather: current for the rank's window only
};

using Placement = std::vector<std::vector<std::vector<int64_t>>>;

std::vector<float> all_grads(GpuTransformer& gpu, Transformer<float>& host) {
  gpu.download_grads(host.params());
  std::vector<float> grads;
  auto& params = host.params();
  for (int id = 0; id < params.size(); ++id) grads.insert(grads.end(), params.grad(id), params.grad(id) + params.numel(id));
  return grads;
}

// As the trainer does under expert parallelism: AdamW over the shared parameters and this
// rank's experts only (the others' copies then keep their values until sent).
void step_own_experts_only(GpuTransformer& gpu, GpuOptimizer& optimizer, Transformer<float>& host, int rank) {
  const auto stage_of = [&](const std::string& name) { return host.backward_stage_of(name); };
  const ExpertLayout layout = gpu.expert_layout();
  const dist::ExpertParallelRanges ranges = dist::gradient_ranges_by_stage_ep(
      host.params(), stage_of, host.backward_stages(), own_expert_ranges(layout, rank), hinge_ranges(layout));
  optimizer.set_step_ranges(ranges.stepped(), {{0, gpu.parameters().storage_numel()}});
}

// Split experts: each hinge's partial gradients summed over the two ranks (the trainer's
// all-rank sum of hinge_ranges), in the device's slot layout.
void sum_hinge_grads(GpuTransformer& gpu, PairShared& shared, int rank) {
  GpuParameterStore& store = gpu.parameters();
  std::vector<float> grads(static_cast<size_t>(store.storage_numel()));
  ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(gpu.stream())), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(grads.data(), store.grads(), grads.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  shared.posted[static_cast<size_t>(rank)].grads = grads.data();
  shared.sync.arrive_and_wait();
  const float* other = shared.posted[static_cast<size_t>(1 - rank)].grads;
  std::vector<float> sums;
  const RangeList ranges = hinge_ranges(gpu.expert_layout());
  for (const auto& [offset, count] : ranges)
    for (int64_t i = offset; i < offset + count; ++i) sums.push_back(grads[static_cast<size_t>(i)] + other[i]);
  shared.sync.arrive_and_wait();  // both have read
  size_t at = 0;
  for (const auto& [offset, count] : ranges)
    for (int64_t i = offset; i < offset + count; ++i) grads[static_cast<size_t>(i)] = sums[at++];
  ASSERT_EQ(cudaMemcpy(store.grads(), grads.data(), grads.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
}

// Both ranks, one micro-batch of one sequence each (rank r: batch seed 40 + r), an AdamW
// step (which leaves the copies of other ranks' experts stale: they get no gradient), an
// optional re-placement, and a second micro-batch (seed 50 + r).
std::array<RankRun, 2> run_pair(const ModelConfig& config, const Placement& placement, int* broadcasts = nullptr,
                                bool own_steps = false, bool split = false, double lr = 1e-2,
                                const GpuModelOptions& base = {}) {
  PairShared shared;
  std::array<RankRun, 2> runs;
  auto rank_main = [&](int rank) {
    Transformer<float> host(config, 11);
    auto exchange = std::make_shared<PairExchange>(shared, rank);
    GpuModelOptions options = base;
    options.expert_exchange = exchange;
    options.max_local_experts = config.moe.n_experts;
    options.split_experts = split;
    GpuTransformer gpu(config, host.params(), options);
    GpuOptimizer optimizer(gpu.parameters(), host.params(), gpu.stream());
    gpu.plan(1);
    if (own_steps) step_own_experts_only(gpu, optimizer, host, rank);
    RankRun& run = runs[static_cast<size_t>(rank)];
    gpu.parameters().zero_grads();
    const auto inputs = tokens(config, 1, 40 + rank, 0), targets = tokens(config, 1, 40 + rank, 1);
    run.loss = gpu.forward_backward(inputs.data(), targets.data(), 1.0);
    run.grads = all_grads(gpu, host);  // before the hinges' sum: each rank's part
    if (split) sum_hinge_grads(gpu, shared, rank);
    optimizer.adamw_step(AdamWStep{lr, 0.9, 0.95, 1e-8, 0.1, 1}, 1.0f);
    if (!placement.empty()) gpu.place_experts(placement);
    if (own_steps) step_own_experts_only(gpu, optimizer, host, rank);
    gpu.parameters().zero_grads();
    gpu.routing().reset_stats();
    const auto inputs2 = tokens(config, 1, 50 + rank, 0), targets2 = tokens(config, 1, 50 + rank, 1);
    run.second_loss = gpu.forward_backward(inputs2.data(), targets2.data(), 1.0);
    run.second_grads = all_grads(gpu, host);
    if (split) sum_hinge_grads(gpu, shared, rank);
    run.load = gpu.routing().stats().load;
    // What a checkpoint writes: every expert's weights and moments from the rank holding it.
    optimizer.adamw_step(AdamWStep{lr, 0.9, 0.95, 1e-8, 0.1, 2}, 1.0f);
    download_params(gpu.parameters(), host.params());  // what this rank holds, in slot order
    for (int id = 0; id < host.params().size(); ++id)
      run.held.insert(run.held.end(), host.params().value(id), host.params().value(id) + host.params().numel(id));
    gpu.download_state(host.params(), run.m, run.v);
    auto& params = host.params();
    for (int id = 0; id < params.size(); ++id)
      run.values.insert(run.values.end(), params.value(id), params.value(id) + params.numel(id));
    if (broadcasts && rank == 0) *broadcasts = exchange->broadcasts;
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  return runs;
}

// Which expert (and which tensor element) each gradient element belongs to: -1 for the
// shared parameters.
std::vector<int64_t> expert_of_element(const ModelConfig& config) {
  Transformer<float> host(config, 11);
  const auto& params = host.params();
  std::vector<int64_t> expert;
  for (int id = 0; id < params.size(); ++id) {
    const bool is_expert = !params.spec(id).expert_group.empty();
    const int64_t per_expert = is_expert ? params.numel(id) / params.spec(id).shape[0] : 1;
    for (int64_t i = 0; i < params.numel(id); ++i) expert.push_back(is_expert ? i / per_expert : -1);
  }
  return expert;
}

// One GPU on both ranks' first micro-batches: the mean loss and gradients of the two.
std::pair<ForwardResult, std::vector<float>> one_gpu_reference(const ModelConfig& config,
                                                               const GpuModelOptions& options = {}) {
  Transformer<float> host(config, 11);
  GpuTransformer one(config, host.params(), options);
  one.plan(2);
  one.parameters().zero_grads();
  std::vector<int32_t> inputs = tokens(config, 1, 40, 0), targets = tokens(config, 1, 40, 1);
  for (int32_t t : tokens(config, 1, 41, 0)) inputs.push_back(t);
  for (int32_t t : tokens(config, 1, 41, 1)) targets.push_back(t);
  const ForwardResult loss = one.forward_backward(inputs.data(), targets.data(), 1.0);
  return {loss, all_grads(one, host)};
}

class GpuExpertParallelPair : public ::testing::TestWithParam<double> {};

TEST_P(GpuExpertParallelPair, TwoRanksMatchOneGpuAndReplacementChangesNoBit) {
  MOE_REQUIRE_GPU();
  const ModelConfig config = pair_config(GetParam());
  const auto [want_loss, want] = one_gpu_reference(config);

  const std::array<RankRun, 2> pair = run_pair(config, {});
  const std::vector<int64_t> expert = expert_of_element(config);
  ASSERT_EQ(expert.size(), want.size());
  // Shared gradients: the mean of the ranks'; expert e's: on its rank (equal blocks: e / 4)
  // over both micro-batches, halved; zero on the other rank.
  double max_abs = 0, max_err = 0;
  size_t stray = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    float got;
    if (expert[i] < 0) {
      got = (pair[0].grads[i] + pair[1].grads[i]) / 2;
    } else {
      const size_t holder = static_cast<size_t>(expert[i] / 4);
      got = pair[holder].grads[i] / 2;
      stray += pair[1 - holder].grads[i] != 0.0f;
    }
    max_abs = std::max(max_abs, std::fabs(static_cast<double>(want[i])));
    max_err = std::max(max_err, std::fabs(static_cast<double>(got) - want[i]));
  }
  EXPECT_EQ(stray, 0u) << "a rank has gradients for experts it does not hold";
  // With a capacity each rank drops by its own micro-batch's count: one GPU over both is
  // another routing, so only the dropless runs compare with it.
  if (GetParam() == 0) {
    EXPECT_NEAR((pair[0].loss.ce_loss + pair[1].loss.ce_loss) / 2, want_loss.ce_loss, 2e-3 * want_loss.ce_loss);
    EXPECT_LT(max_err, 2e-2 * max_abs) << "largest gradient " << max_abs;
  } else {
    EXPECT_GT(pair[0].loss.dropped + pair[1].loss.dropped, 0) << "the capacity case should drop";
  }

  // Re-placed after the AdamW step: MoE layer 1 (collapsed-router shape) expert 5 alone on
  // rank 0; layer 2 shuffled 3 / 5; layer 3 everything on rank 1. With top-2 a token's
  // partial combines split differently over the ranks (bf16 partial sums): close. With
  // top-1 each token's output comes from one rank: the very same bits.
  const Placement replaced = {{{5}, {0, 1, 2, 3, 4, 6, 7}}, {{7, 2, 4}, {6, 0, 1, 3, 5}}, {{}, {3, 1, 0, 2, 4, 5, 6, 7}}};
  int broadcasts = 0;
  const std::array<RankRun, 2> moved = run_pair(config, replaced, &broadcasts);
  EXPECT_GT(broadcasts, 0) << "experts changing ranks come from their old holder";
  for (int r = 0; r < 2; ++r)
    EXPECT_NEAR(moved[r].second_loss.ce_loss, pair[r].second_loss.ce_loss, 2e-3 * pair[r].second_loss.ce_loss);
  ModelConfig top1 = config;
  top1.moe.top_k = 1;
  const std::array<RankRun, 2> pair1 = run_pair(top1, {}), moved1 = run_pair(top1, replaced);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(moved1[r].second_loss.ce_loss, pair1[r].second_loss.ce_loss) << "rank " << r;
    EXPECT_EQ(moved1[r].second_loss.dropped, pair1[r].second_loss.dropped) << "rank " << r;
    EXPECT_EQ(moved1[r].load, pair1[r].load) << "rank " << r;
  }
  // Shared gradients bit for bit on each rank; each expert's from whichever rank holds it.
  size_t differing = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& a = moved1[0].second_grads, &b = moved1[1].second_grads;
    const auto& c = pair1[0].second_grads, &d = pair1[1].second_grads;
    if (expert[i] < 0)
      differing += a[i] != c[i] || b[i] != d[i];
    else
      differing += a[i] + b[i] != c[i] + d[i];
  }
  EXPECT_EQ(differing, 0u) << "re-placed experts changed gradients";
  // The gathered state (in expert order on the host) is the same, and both ranks hold the
  // same experts.
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(moved1[r].values == pair1[r].values) << "rank " << r << ": gathered weights differ";
    EXPECT_TRUE(moved1[r].m == pair1[r].m && moved1[r].v == pair1[r].v) << "rank " << r << ": gathered moments differ";
  }
  size_t expert_mismatch = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (expert[i] >= 0) expert_mismatch += moved1[0].values[i] != moved1[1].values[i];
  EXPECT_EQ(expert_mismatch, 0u) << "the ranks' gathered experts differ";
  // Each rank stepping only the shared parameters and its own experts (the trainer's way)
  // changes nothing that is gathered.
  const std::array<RankRun, 2> own1 = run_pair(top1, replaced, nullptr, /*own_steps=*/true);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(own1[r].second_loss.ce_loss, moved1[r].second_loss.ce_loss) << "rank " << r;
    EXPECT_TRUE(own1[r].values == moved1[r].values) << "rank " << r << ": stepping own experts only";
    EXPECT_TRUE(own1[r].m == moved1[r].m && own1[r].v == moved1[r].v) << "rank " << r << ": moments";
  }
}

// Split experts: each rank also holds the first expert of the next rank's block (rank 0
// computes part of expert 4 in equal blocks), every micro-batch's cut divides its rows.
// Against one GPU: each element's gradient is the two ranks' sum (the hinge's partial
// sums, the others' from their holder alone); after the hinge sums and own-expert steps
// (both ranks step the hinge), training follows the whole-expert pair closely, re-placed
// too (an empty block: the rank computes only a part of its hinge).
TEST_P(GpuExpertParallelPair, SplitExpertsMatchOneGpuAndWholeExperts) {
  MOE_REQUIRE_GPU();
  const ModelConfig config = pair_config(GetParam());
  const auto [want_loss, want] = one_gpu_reference(config);

  // A small learning rate: at 1e-2 a first AdamW step moves these weights by half their
  // size, and the runs' rounding differences then grow into different second steps.
  const double lr = 1e-4;
  const std::array<RankRun, 2> split = run_pair(config, {}, nullptr, /*own_steps=*/true, /*split=*/true, lr);
  const std::array<RankRun, 2> whole = run_pair(config, {}, nullptr, /*own_steps=*/true, false, lr);
  const std::vector<int64_t> expert = expert_of_element(config);
  double max_abs = 0, max_err = 0;
  size_t stray = 0, hinge_on_0 = 0, hinge_on_1 = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const float got = (split[0].grads[i] + split[1].grads[i]) / 2;
    max_abs = std::max(max_abs, std::fabs(static_cast<double>(want[i])));
    max_err = std::max(max_err, std::fabs(static_cast<double>(got) - want[i]));
    if (expert[i] == 4) {
      hinge_on_0 += split[0].grads[i] != 0.0f;
      hinge_on_1 += split[1].grads[i] != 0.0f;
    } else if (expert[i] >= 0) {
      stray += split[1 - expert[i] / 4].grads[i] != 0.0f;
    }
  }
  EXPECT_EQ(stray, 0u) << "a rank has gradients for experts outside its window";
  EXPECT_GT(hinge_on_0, 0u) << "rank 0 computed none of its hinge's rows";
  EXPECT_GT(hinge_on_1, 0u) << "rank 1 computed none of expert 4's rows";
  if (GetParam() == 0) {
    EXPECT_NEAR((split[0].loss.ce_loss + split[1].loss.ce_loss) / 2, want_loss.ce_loss, 2e-3 * want_loss.ce_loss);
    EXPECT_LT(max_err, 2e-2 * max_abs) << "largest gradient " << max_abs;
  }
  // After a step: close to whole experts (the hinge's gradient a sum of two partial sums,
  // the tokens' partial combines grouped differently), the same experts on both ranks.
  // AdamW's first steps move each weight by about the learning rate whatever the
  // gradient's size, so a near-zero gradient rounded the other way moves that weight by
  // up to 2 lr: count the weights further off than lr / 2 (a step the other way).
  auto far_off = [&](const std::vector<float>& a, const std::vector<float>& b) {
    size_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += std::fabs(static_cast<double>(a[i]) - b[i]) > lr / 2;
    return static_cast<double>(n) / static_cast<double>(a.size());
  };
  for (int r = 0; r < 2; ++r) {
    EXPECT_NEAR(split[r].second_loss.ce_loss, whole[r].second_loss.ce_loss, 2e-3 * whole[r].second_loss.ce_loss);
    EXPECT_LT(far_off(split[r].values, whole[r].values), 0.01) << "rank " << r << ": weights after two steps";
  }
  size_t expert_mismatch = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (expert[i] >= 0) expert_mismatch += split[0].values[i] != split[1].values[i];
  EXPECT_EQ(expert_mismatch, 0u) << "the ranks' gathered experts differ";
  // Both ranks stepped the hinge with the same summed gradient: the same bits before any gather.
  size_t hinge_mismatch = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (expert[i] == 4) hinge_mismatch += split[0].held[i] != split[1].held[i];
  EXPECT_EQ(hinge_mismatch, 0u) << "the hinge's two copies differ";
  const Placement replaced = {{{5}, {0, 1, 2, 3, 4, 6, 7}}, {{7, 2, 4}, {6, 0, 1, 3, 5}}, {{}, {3, 1, 0, 2, 4, 5, 6, 7}}};
  const std::array<RankRun, 2> moved = run_pair(config, replaced, nullptr, true, true, lr);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NEAR(moved[r].second_loss.ce_loss, whole[r].second_loss.ce_loss, 2e-3 * whole[r].second_loss.ce_loss);
    EXPECT_LT(far_off(moved[r].values, whole[r].values), 0.01) << "rank " << r << ": re-placed, split";
  }
}

INSTANTIATE_TEST_SUITE_P(Routing, GpuExpertParallelPair, ::testing::Values(0.0, 1.0));

// fp8 weight gradients (training.fp8_weight_gradients) at EP 2: each rank's experts take
// rows from both ranks, their token columns padded per local expert. fp8 runs do not
// compare with one GPU element by element (cuBLAS's bf16 rounding differs between one
// batch of two sequences and two of one, and fp8 codes turn those last-bit differences
// into whole-code ones: gradients ~20% apart while the losses agree to 1e-4), so the
// reference is the same EP run with the bf16 weight-gradient GEMMs: the losses and every
// non-expert gradient bit-identical (the fp8 weight GEMMs write only the experts'
// weight gradients), the experts' within a few percent, none on the rank not holding an
// expert. Re-placed with MoE layer 3 wholly on rank 1, rank 0 runs that layer with no
// local expert and no act buffer at all: the second step stays finite and close.

// Both scalings of the weight GEMMs' B operand (training.fp8_weight_gradient_scales).
class GpuExpertParallelFp8 : public ::testing::TestWithParam<Fp8ColumnScales> {};

TEST_P(GpuExpertParallelFp8, WeightGradientsInFp8MoveOnlyTheExpertsAndSurviveAnEmptyRank) {
  MOE_REQUIRE_GPU();
  const ModelConfig config = pair_config(0.0);
  GpuModelOptions fp8;
  fp8.fp8_experts = true;
  GpuModelOptions fp8_wgrad = fp8;
  fp8_wgrad.fp8_weight_gradients = true;
  fp8_wgrad.fp8_weight_gradient_scales = GetParam();
  const std::array<RankRun, 2> bf16_gemms = run_pair(config, {}, nullptr, false, false, 1e-2, fp8);
  const std::array<RankRun, 2> fp8_gemms = run_pair(config, {}, nullptr, false, false, 1e-2, fp8_wgrad);
  const std::vector<int64_t> expert = expert_of_element(config);
  ASSERT_EQ(expert.size(), bf16_gemms[0].grads.size());
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(fp8_gemms[r].loss.ce_loss, bf16_gemms[r].loss.ce_loss) << "rank " << r;
    // Non-expert elements: the same bits. The rank's own experts' elements: close (the
    // others are zero in both).
    std::vector<float> got, want;
    size_t moved_shared = 0, stray = 0;
    for (size_t i = 0; i < expert.size(); ++i) {
      if (expert[i] < 0) {
        moved_shared += fp8_gemms[r].grads[i] != bf16_gemms[r].grads[i];
      } else if (static_cast<size_t>(expert[i] / 4) != r) {
        stray += fp8_gemms[r].grads[i] != 0.0f;
      } else {
        got.push_back(fp8_gemms[r].grads[i]);
        want.push_back(bf16_gemms[r].grads[i]);
      }
    }
    EXPECT_EQ(moved_shared, 0u) << "rank " << r << ": a non-expert gradient moved";
    EXPECT_EQ(stray, 0u) << "rank " << r << " has gradients for experts it does not hold";
    const double moved = relative_l2(got, want);
    std::printf("  rank %zu: its experts' weight gradients %.4f from the bf16 weight-gradient GEMMs'\n", r, moved);
    EXPECT_GT(moved, 0.0) << "rank " << r << ": the fp8 weight gradients did not run";
    EXPECT_LT(moved, 0.1) << "rank " << r;  // as on one GPU (GpuFp8WeightGradients): a few percent
  }
  // The one GPU agrees on the loss (its gradients differ by fp8's rounding, above).
  const auto [one_loss, one_grads] = one_gpu_reference(config, fp8_wgrad);
  EXPECT_NEAR((fp8_gemms[0].loss.ce_loss + fp8_gemms[1].loss.ce_loss) / 2, one_loss.ce_loss, 2e-3 * one_loss.ce_loss);
  const Placement replaced = {{{5}, {0, 1, 2, 3, 4, 6, 7}}, {{7, 2, 4}, {6, 0, 1, 3, 5}}, {{}, {3, 1, 0, 2, 4, 5, 6, 7}}};
  const std::array<RankRun, 2> moved = run_pair(config, replaced, nullptr, false, false, 1e-2, fp8_wgrad);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(std::isfinite(moved[r].second_loss.ce_loss)) << "rank " << r;
    EXPECT_NEAR(moved[r].second_loss.ce_loss, fp8_gemms[r].second_loss.ce_loss,
                2e-3 * fp8_gemms[r].second_loss.ce_loss)
        << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(BScales, GpuExpertParallelFp8,
                         ::testing::Values(Fp8ColumnScales::Tile1x128, Fp8ColumnScales::Block128x128));

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// A rank keeps memory for its own experts only: at EP 2 the store holds the non-expert
// parameters and half of every expert tensor (up to the chunks the ranges round to), and
// after a re-placement that gives rank 0 six experts of eight, three quarters.
TEST(GpuExpertParallelMemory, ARankHoldsItsOwnExpertsOnly) {
  MOE_REQUIRE_GPU();
  ModelConfig c = test::small_moe_model(0.0);
  c.dim = 512;
  c.moe.expert_hidden = 2048;  // 1 M elements per expert and tensor: many 2 MB chunks
  c.moe.n_shared_experts = 0;
  c.n_layers = 3;
  Transformer<float> host(c, 11);
  GpuTransformer whole(c, host.params());
  const size_t whole_bytes = whole.parameters().device_bytes();
  int64_t expert_elements = 0;
  for (const MoeLayerExperts& layer : whole.expert_layout())
    for (const Range& tensor : layer.tensors) expert_elements += tensor.count;
  const double per_element = static_cast<double>(GpuParameterStore::bytes_per_parameter(MomentDtype::Fp32));
  const double slack = 5.0 * 2 * 3 * 2 * (2 << 20);  // 5 blocks x 2 MoE layers x 3 tensors x 2 edges x a chunk
  PairShared shared;
  std::array<size_t, 2> equal_bytes{}, moved_bytes{};
  auto rank_main = [&](int rank) {
    GpuModelOptions options;
    options.expert_exchange = std::make_shared<PairExchange>(shared, rank);
    options.max_local_experts = 6;
    GpuTransformer gpu(c, host.params(), options);
    equal_bytes[static_cast<size_t>(rank)] = gpu.parameters().device_bytes();
    gpu.plan(1);
    gpu.place_experts({{{0, 1, 2, 3, 4, 5}, {6, 7}}, {{7, 6, 5, 4, 3, 2}, {1, 0}}});
    moved_bytes[static_cast<size_t>(rank)] = gpu.parameters().device_bytes();
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  for (int rank = 0; rank < 2; ++rank) {
    const double kept_equal = 0.5, kept_moved = rank == 0 ? 0.75 : 0.25;
    EXPECT_NEAR(static_cast<double>(equal_bytes[rank]), whole_bytes - (1 - kept_equal) * expert_elements * per_element,
                slack) << "rank " << rank;
    EXPECT_NEAR(static_cast<double>(moved_bytes[rank]), whole_bytes - (1 - kept_moved) * expert_elements * per_element,
                slack) << "rank " << rank << " after the re-placement";
  }
}

}  // namespace
}  // namespace moe
