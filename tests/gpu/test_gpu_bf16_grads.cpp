// training.expert_grad_dtype = bf16 (GpuModelOptions::bf16_expert_grads): the expert
// tensors' gradients in a bf16 block, everything else unchanged.
// - the grouped weight-gradient GEMM into bf16 is the fp32 one rounded once (nearest
//   even), bit for bit, and within bf16 of a double reference; empty experts untouched;
// - the store keeps bf16 exactly what upload_grads rounds, and its device bytes;
// - norm, per-expert clipping and AdamW against the CPU's on the bf16-rounded gradients
//   (optim/grad_clip.cpp, optim/adamw.cpp), bit for bit;
// - a model's backward: every non-expert gradient bit-identical to the fp32 run's, every
//   expert gradient its fp32 one rounded (one micro-batch), within bf16 after two; and
//   re-placement moving the bf16 gradients with their experts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "gpu_test_util.h"
#include "kernels/adamw_math.h"
#include "kernels/gpu_ops.h"
#include "model/cuda/gpu_parameter_io.h"
#include "model/cuda/gpu_parameters.h"
#include "model/cuda/gpu_transformer.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "optim/cuda/gpu_optimizer.h"
#include "optim/gpu_ops.h"
#include "optim/grad_clip.h"

namespace moe {
namespace {

namespace am = adamw_math;

uint32_t bits(float x) { return am::float_bits(x); }
float round_bf16(float x) { return am::round_to_bf16(x); }

// Ragged experts, empty ones first, in the middle and last.
TEST(GpuBf16Grads, GroupedWeightGemmIsTheFp32OneRoundedOnce) {
  MOE_REQUIRE_GPU();
  const std::vector<int32_t> rows = {0, 37, 200, 0, 1, 130, 0};
  const int64_t E = static_cast<int64_t>(rows.size()), M = 96, N = 136;
  std::vector<int32_t> offsets(rows.size() + 1, 0);
  std::partial_sum(rows.begin(), rows.end(), offsets.begin() + 1);
  const int64_t R = offsets[E] + 5;  // rows past the last expert: never read into a gradient
  const auto a = random_bf16_floats(R * 2 * M, 21, "a");  // two sets, [R, 2M]
  const auto b = random_bf16_floats(R * N, 22, "b");
  const auto before0 = random_bf16_floats(E * M * N, 23, "before0", 0.5);
  const auto before1 = random_bf16_floats(E * M * N, 24, "before1", 0.5);
  auto a_d = to_device_bf16(a), b_d = to_device_bf16(b);
  auto offsets_d = to_device(offsets);
  cuda::ExpertGemm gemm(E);
  const bf16* as[2] = {a_d.data(), a_d.data() + M};
  // fp32 gradients starting at the bf16 values, and bf16 ones.
  auto f0 = to_device(before0), f1 = to_device(before1);
  auto h0 = to_device_bf16(before0), h1 = to_device_bf16(before1);
  float* fs[2] = {f0.data(), f1.data()};
  bf16* hs[2] = {h0.data(), h1.data()};
  gemm.backward_weight(2, fs, as, 2 * M, b_d.data(), N, offsets_d.data(), M, N, nullptr);
  gemm.backward_weight(2, hs, as, 2 * M, b_d.data(), N, offsets_d.data(), M, N, nullptr);
  for (int s = 0; s < 2; ++s) {
    SCOPED_TRACE("set " + std::to_string(s));
    const std::vector<float>& before = s == 0 ? before0 : before1;
    const std::vector<float> fp32 = to_host(s == 0 ? f0 : f1);
    const std::vector<float> got = to_host_float(s == 0 ? h0 : h1);
    size_t not_rounded = 0;
    for (size_t i = 0; i < got.size(); ++i) not_rounded += bits(got[i]) != bits(round_bf16(fp32[i]));
    EXPECT_EQ(not_rounded, 0u) << "the bf16 output is not the fp32 result rounded to nearest even";
    std::vector<float> want(before);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = before[(e * M + m) * N + n];
          for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) acc += double(a[r * 2 * M + s * M + m]) * b[r * N + n];
          want[(e * M + m) * N + n] = static_cast<float>(acc);
        }
    expect_close("bf16 grouped wgrad", got, want, kBf16Rtol, 1e-3);
    for (int64_t e = 0; e < E; ++e)
      if (rows[static_cast<size_t>(e)] == 0)
        for (int64_t i = e * M * N; i < (e + 1) * M * N; ++i) ASSERT_EQ(bits(got[i]), bits(before[i])) << "empty expert " << e;
  }
}

// beta = 0 (a step's first micro-batch): from NaN-filled gradients, the same bits as beta =
// 1 onto zeros, fp32 and bf16; the experts without rows end at zero.
TEST(GpuBf16Grads, GroupedWeightGemmWithBetaZeroWritesWithoutReading) {
  MOE_REQUIRE_GPU();
  const std::vector<int32_t> rows = {0, 37, 200, 0, 1, 130, 0};
  const int64_t E = static_cast<int64_t>(rows.size()), M = 96, N = 136;
  std::vector<int32_t> offsets(rows.size() + 1, 0);
  std::partial_sum(rows.begin(), rows.end(), offsets.begin() + 1);
  const int64_t R = offsets[E];
  const auto a = random_bf16_floats(R * M, 25, "a"), b = random_bf16_floats(R * N, 26, "b");
  auto a_d = to_device_bf16(a), b_d = to_device_bf16(b);
  auto offsets_d = to_device(offsets);
  cuda::ExpertGemm gemm(E);
  const bf16* as[1] = {a_d.data()};
  const std::vector<float> zeros(static_cast<size_t>(E * M * N), 0.0f);
  auto f_zeroed = to_device(zeros);
  auto h_zeroed = to_device_bf16(zeros);
  auto f_written = poisoned<float>(static_cast<size_t>(E * M * N));
  auto h_written = poisoned<bf16>(static_cast<size_t>(E * M * N));
  float* f[2] = {f_zeroed.data(), f_written.data()};
  bf16* h[2] = {h_zeroed.data(), h_written.data()};
  for (int k = 0; k < 2; ++k) {
    gemm.backward_weight(1, &f[k], as, M, b_d.data(), N, offsets_d.data(), M, N, nullptr, k == 0 ? 1.0f : 0.0f);
    gemm.backward_weight(1, &h[k], as, M, b_d.data(), N, offsets_d.data(), M, N, nullptr, k == 0 ? 1.0f : 0.0f);
  }
  const std::vector<float> fz = to_host(f_zeroed), fw = to_host(f_written);
  const std::vector<float> hz = to_host_float(h_zeroed), hw = to_host_float(h_written);
  size_t bad_f = 0, bad_h = 0, nonzero = 0;
  for (size_t i = 0; i < fz.size(); ++i) {
    bad_f += bits(fw[i]) != bits(fz[i]);
    bad_h += bits(hw[i]) != bits(hz[i]);
    nonzero += fz[i] != 0.0f;
  }
  EXPECT_EQ(bad_f, 0u) << "fp32, beta 0 vs beta 1 onto zeros";
  EXPECT_EQ(bad_h, 0u) << "bf16, beta 0 vs beta 1 onto zeros";
  EXPECT_GT(nonzero, 0u);
  for (int64_t e = 0; e < E; ++e)
    if (rows[static_cast<size_t>(e)] == 0)
      for (int64_t i = e * M * N; i < (e + 1) * M * N; ++i) ASSERT_EQ(bits(fw[i]), 0u) << "empty expert " << e;
}

// Dense parameters around two MoE layers' expert tensors ([E, ...], expert_group set):
// ragged sizes across norm chunks, some without decay.
constexpr int64_t kE = 4;
void make_params(ParameterStore<float>& params) {
  const int64_t C = am::kNormChunk;
  params.add({"dense0", Shape{C + 1}, Init::Normal, 0.3});
  for (int layer = 0; layer < 2; ++layer) {
    const std::string group = "layers." + std::to_string(layer) + ".moe.experts";
    params.add({group + ".w1", Shape{kE, 96, 200}, Init::Normal, 0.3, true, group});
    params.add({group + ".w3", Shape{kE, 96, 200}, Init::Normal, 0.3, true, group});
    params.add({group + ".w2", Shape{kE, 200, 96}, Init::Normal, 0.3, true, group});
    ParamSpec norm{"norm" + std::to_string(layer), Shape{15}, Init::Normal, 0.3};
    norm.weight_decay = false;
    params.add(norm);
  }
  params.add({"dense1", Shape{3 * C + 7}, Init::Normal, 0.3});
  params.allocate(13);
}

bool is_expert(const ParameterStore<float>& params, int id) { return !params.spec(id).expert_group.empty(); }

void fill_grads(ParameterStore<float>& params, int64_t step, double scale) {
  CounterRng rng(19, "bf16_grads");
  for (int id = 0; id < params.size(); ++id) {
    // One expert per layer far larger, so that per-expert clipping picks it.
    for (int64_t i = 0; i < params.numel(id); ++i) {
      const bool loud = is_expert(params, id) && i < params.numel(id) / kE;
      params.grad(id)[i] = static_cast<float>((loud ? 30 : 1) * scale *
                                              rng.normal(static_cast<uint64_t>(step) << 40 | uint64_t(id) << 32 | uint64_t(i)));
    }
  }
}

// The host gradients as the store holds them: the expert ones rounded to bf16.
void round_expert_grads(ParameterStore<float>& params) {
  for (int id = 0; id < params.size(); ++id)
    if (is_expert(params, id))
      for (int64_t i = 0; i < params.numel(id); ++i) params.grad(id)[i] = round_bf16(params.grad(id)[i]);
}

TEST(GpuBf16Grads, StoreKeepsTheRoundedGradientsAndFewerBytes) {
  MOE_REQUIRE_GPU();
  ParameterStore<float> params;
  make_params(params);
  GpuParameterStore gpu(params, MomentDtype::Fp32, {}, nullptr, {}, /*bf16_expert_grads=*/true);
  ASSERT_NE(gpu.grads_bf16(), nullptr);
  int64_t expert_numel = 0;
  for (int id = 0; id < params.size(); ++id) expert_numel += is_expert(params, id) ? params.numel(id) : 0;
  int64_t in_ranges = 0;
  for (const Range& r : gpu.bf16_grad_ranges()) in_ranges += r.count;
  EXPECT_EQ(in_ranges, expert_numel);
  fill_grads(params, 1, 1.0);
  upload_grads(gpu, params);
  round_expert_grads(params);
  ParameterStore<float> holder;
  make_params(holder);
  download_grads(gpu, holder);
  size_t bad = 0;
  for (int id = 0; id < params.size(); ++id)
    for (int64_t i = 0; i < params.numel(id); ++i) bad += bits(holder.grad(id)[i]) != bits(params.grad(id)[i]);
  EXPECT_EQ(bad, 0u);
  gpu.zero_grads();
  download_grads(gpu, holder);
  for (int id = 0; id < params.size(); ++id)
    for (int64_t i = 0; i < params.numel(id); ++i) ASSERT_EQ(bits(holder.grad(id)[i]), 0u) << params.spec(id).name;
  // 2 bytes fewer per expert weight; each block rounds its resident ranges out to whole
  // 2 MiB chunks (the fp32 gradients' three small ranges a chunk or two each).
  EXPECT_EQ(GpuParameterStore::bytes_per_parameter(MomentDtype::Fp32, true), 14.0);
  const size_t want = static_cast<size_t>(gpu.storage_numel()) *
                          static_cast<size_t>(GpuParameterStore::bytes_per_parameter(MomentDtype::Fp32)) -
                      static_cast<size_t>(expert_numel) * 2;
  EXPECT_GE(gpu.device_bytes(), want);
  EXPECT_LE(gpu.device_bytes(), want + 14 * (size_t{2} << 20));
}

class GpuBf16GradsOptimizer : public ::testing::TestWithParam<MomentDtype> {};

// Per-expert clipping (the GPU scales the bf16 gradient and rounds it once), the global
// norm and AdamW over the rounded gradients: the CPU's clip_gradients (expert part, then
// the rounding, then the global part) and AdamW, bit for bit.
TEST_P(GpuBf16GradsOptimizer, ClipAndAdamWMatchTheCpuOnRoundedGradients) {
  MOE_REQUIRE_GPU();
  ParameterStore<float> params;
  make_params(params);
  OptimizerConfig oc;
  oc.weight_decay = 0.1;
  oc.state_dtype = GetParam();
  AdamW cpu(oc, params);
  GpuParameterStore gpu(params, GetParam(), {}, nullptr, {}, /*bf16_expert_grads=*/true);
  GpuOptimizer optimizer(gpu, params, nullptr);
  const double max_norm = 1.0;
  for (int64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    fill_grads(params, step, step % 2 == 0 ? 1.0 : 1e-4);
    upload_grads(gpu, params);
    round_expert_grads(params);
    const double max_expert = step % 2 == 0 ? 10.0 : 0.0;
    const ClipStats experts = clip_gradients(params, 0.0, max_expert);
    round_expert_grads(params);
    const ClipStats global = clip_gradients(params, max_norm, 0.0);
    const std::vector<double> norms = optimizer.clip_expert_grads(max_expert);
    ASSERT_EQ(norms.size(), static_cast<size_t>(2 * kE));
    EXPECT_EQ(*std::max_element(norms.begin(), norms.end()), experts.max_expert_norm);
    EXPECT_EQ(std::count_if(norms.begin(), norms.end(), [&](double n) { return max_expert > 0 && n > max_expert; }),
              experts.experts_clipped);
    if (step % 2 == 0) EXPECT_GT(experts.experts_clipped, 0);
    const double lr = 1e-3 * static_cast<double>(step);
    optimizer.clip_and_adamw_step(AdamWStep{lr, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, step}, max_norm);
    cpu.step(lr);
    EXPECT_EQ(optimizer.last_grad_norm(), global.global_norm);
    EXPECT_FALSE(optimizer.last_step_skipped());
    ParameterStore<float> holder;
    make_params(holder);
    std::vector<float> m, v;
    download_state(gpu, holder, m, v);
    size_t bad_p = 0, bad_m = 0, bad_v = 0, packed = 0;
    for (int id = 0; id < params.size(); ++id)
      for (int64_t i = 0; i < params.numel(id); ++i, ++packed) {
        bad_p += bits(holder.value(id)[i]) != bits(params.value(id)[i]);
        bad_m += bits(m[packed]) != bits(cpu.first_moment()[packed]);
        bad_v += bits(v[packed]) != bits(cpu.second_moment()[packed]);
      }
    EXPECT_EQ(bad_p, 0u) << "parameters differ";
    EXPECT_EQ(bad_m, 0u) << "first moments differ";
    EXPECT_EQ(bad_v, 0u) << "second moments differ";
  }
  // A non-finite bf16 gradient makes the step skipped.
  params.grad(2)[5] = std::numeric_limits<float>::infinity();
  upload_grads(gpu, params);
  optimizer.clip_and_adamw_step(AdamWStep{1e-3, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, 5}, max_norm);
  EXPECT_TRUE(optimizer.last_step_skipped());
}

INSTANTIATE_TEST_SUITE_P(Moments, GpuBf16GradsOptimizer, ::testing::Values(MomentDtype::Fp32, MomentDtype::Bf16));

ModelConfig small_model() {
  ModelConfig c;
  c.vocab_size = 384;
  c.dim = 128;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.seq_len = 64;
  c.moe.n_experts = 8;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 128;
  c.moe.n_shared_experts = 1;
  return c;
}

struct Grads {
  std::vector<std::vector<float>> of;  // per parameter
};

// `micro` micro-batches of forward + backward from zeroed gradients (write_first: from
// NaN gradients and begin_gradients, as training starts a step), then (optionally) a
// re-placement reversing every layer's experts; the gradients in expert order.
Grads backward_grads(const ModelConfig& c, bool bf16_grads, int micro, bool replace, bool write_first = false) {
  Transformer<float> host(c, 7);
  GpuModelOptions options;
  options.bf16_expert_grads = bf16_grads;
  GpuTransformer gpu(c, host.params(), options);
  gpu.plan(2);
  if (write_first) {
    auto& params = host.params();
    for (int id = 0; id < params.size(); ++id)
      std::fill_n(params.grad(id), params.numel(id), std::numeric_limits<float>::quiet_NaN());
    upload_grads(gpu.parameters(), params);  // both blocks
    gpu.begin_gradients();
  } else {
    gpu.parameters().zero_grads();
  }
  for (int k = 0; k < micro; ++k) {
    std::vector<int32_t> inputs, targets;
    CounterRng rng(31 + static_cast<uint64_t>(k), "tokens");
    for (int64_t i = 0; i < 2 * c.seq_len; ++i) {
      inputs.push_back(static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[0] % c.vocab_size));
      targets.push_back(static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[1] % c.vocab_size));
    }
    gpu.forward(inputs.data(), targets.data());
    gpu.backward(0.5);
  }
  if (replace) {
    std::vector<int64_t> reversed(static_cast<size_t>(c.moe.n_experts));
    std::iota(reversed.rbegin(), reversed.rend(), 0);
    const auto n_moe = static_cast<size_t>(gpu.expert_layout().size());
    gpu.place_experts(std::vector<std::vector<std::vector<int64_t>>>(n_moe, {reversed}));
  }
  gpu.download_grads(host.params());
  Grads g;
  auto& params = host.params();
  for (int id = 0; id < params.size(); ++id) g.of.emplace_back(params.grad(id), params.grad(id) + params.numel(id));
  return g;
}

// The backward only changes where the expert weight gradients are stored: the non-expert
// gradients are the fp32 run's bit for bit, the expert ones its values rounded once; a
// re-placement (reversing the experts' slots) moves the bf16 gradients with their experts.
TEST(GpuBf16Grads, ModelBackwardRoundsOnlyTheExpertGradients) {
  MOE_REQUIRE_GPU();
  const ModelConfig c = small_model();
  const ParameterStore<float> specs = Transformer<float>::parameter_specs(c);
  const Grads fp32 = backward_grads(c, false, 1, false), bf16 = backward_grads(c, true, 1, false);
  const Grads moved = backward_grads(c, true, 1, true);
  size_t experts = 0;
  for (int id = 0; id < specs.size(); ++id) {
    const std::vector<float>& want = fp32.of[static_cast<size_t>(id)];
    const std::vector<float>& got = bf16.of[static_cast<size_t>(id)];
    const std::vector<float>& after_move = moved.of[static_cast<size_t>(id)];
    size_t bad = 0, bad_moved = 0, nonzero = 0;
    const bool expert = !specs.spec(id).expert_group.empty();
    experts += expert;
    for (size_t i = 0; i < want.size(); ++i) {
      bad += bits(got[i]) != bits(expert ? round_bf16(want[i]) : want[i]);
      bad_moved += bits(after_move[i]) != bits(got[i]);
      nonzero += got[i] != 0.0f;
    }
    EXPECT_EQ(bad, 0u) << specs.spec(id).name;
    EXPECT_EQ(bad_moved, 0u) << specs.spec(id).name << " after the re-placement";
    if (expert) EXPECT_GT(nonzero, 0u) << specs.spec(id).name;
  }
  EXPECT_EQ(experts, 6u);
}

// begin_gradients with bf16 expert gradients: the bf16 grouped GEMM written with beta 0
// gives the zeroed run's bits (one and two micro-batches).
TEST(GpuBf16Grads, WritingTheFirstMicroBatchIsBitIdenticalToZeroing) {
  MOE_REQUIRE_GPU();
  const ModelConfig c = small_model();
  for (int micro : {1, 2}) {
    const Grads zeroed = backward_grads(c, true, micro, false), written = backward_grads(c, true, micro, false, true);
    for (size_t id = 0; id < zeroed.of.size(); ++id) {
      size_t bad = 0;
      for (size_t i = 0; i < zeroed.of[id].size(); ++i) bad += bits(written.of[id][i]) != bits(zeroed.of[id][i]);
      EXPECT_EQ(bad, 0u) << "parameter " << id << ", " << micro << " micro-batches";
    }
  }
}

// Two micro-batches: the bf16 gradient rounds after each, so it is within two bf16
// roundings of the fp32 sum (relative L2 per tensor; the other gradients stay exact).
TEST(GpuBf16Grads, AccumulatedMicroBatchesStayWithinBf16) {
  MOE_REQUIRE_GPU();
  const ModelConfig c = small_model();
  const ParameterStore<float> specs = Transformer<float>::parameter_specs(c);
  const Grads fp32 = backward_grads(c, false, 2, false), bf16 = backward_grads(c, true, 2, false);
  for (int id = 0; id < specs.size(); ++id) {
    const std::vector<float>& want = fp32.of[static_cast<size_t>(id)];
    const std::vector<float>& got = bf16.of[static_cast<size_t>(id)];
    double diff = 0, norm = 0;
    size_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
      norm += double(want[i]) * want[i];
      bad += bits(got[i]) != bits(want[i]);
    }
    if (specs.spec(id).expert_group.empty()) {
      EXPECT_EQ(bad, 0u) << specs.spec(id).name;
    } else {
      EXPECT_LE(std::sqrt(diff / norm), 2.0 / 256) << specs.spec(id).name;
      EXPECT_GT(bad, 0u) << specs.spec(id).name << ": nothing rounded";
    }
  }
}

}  // namespace
}  // namespace moe
