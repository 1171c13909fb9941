// The GPU optimizer against the CPU one, bit for bit: the hi/lo master-weight split, the
// global gradient norm (optim/grad_clip.cpp's sum order), clipping and the multi-tensor
// AdamW with fp32 and bf16 moments (optim/adamw.cpp), the state round trip for
// checkpoints, and all of it through GpuTransformer on a small model (the kernels called
// directly: test_gpu_adamw_kernels.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <string>

#include "dist/zero_shards.h"
#include "gpu_test_util.h"
#include "kernels/adamw_math.h"
#include "kernels/gpu_ops.h"
#include "optim/gpu_ops.h"
#include "model/cuda/gpu_parameter_io.h"
#include "model/cuda/gpu_parameter_zero.h"
#include "model/cuda/gpu_parameters.h"
#include "model/cuda/gpu_transformer.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "optim/cuda/gpu_optimizer.h"
#include "optim/grad_clip.h"

namespace moe {
namespace {

namespace am = adamw_math;

uint32_t bits(float x) { return am::float_bits(x); }
bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

std::vector<uint32_t> bit_patterns() {
  std::vector<uint32_t> patterns;
  const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4321};
  for (uint32_t high = 0; high < 0x10000; ++high)
    for (uint32_t low : lows) patterns.push_back(high << 16 | low);
  for (uint64_t i = 0; i < (uint64_t{1} << 24); ++i) patterns.push_back(static_cast<uint32_t>(i * 2654435761u + 7u));
  return patterns;
}

TEST(GpuOptimizer, SplitAndJoinKernelsMatchTheHostFunctions) {
  MOE_REQUIRE_GPU();
  const std::vector<uint32_t> patterns = bit_patterns();
  const size_t n = patterns.size();
  std::vector<float> x(n);
  std::memcpy(x.data(), patterns.data(), n * sizeof(float));
  auto x_d = test::to_device(x);
  auto hi_d = test::poisoned<bf16>(n);
  auto lo_d = test::poisoned<int16_t>(n);
  cuda::split_master(hi_d.data(), lo_d.data(), x_d.data(), static_cast<int64_t>(n), nullptr);
  auto back_d = test::poisoned<float>(n);
  cuda::join_master(back_d.data(), hi_d.data(), lo_d.data(), static_cast<int64_t>(n), nullptr);
  const auto hi = test::to_host(hi_d);
  const auto lo = test::to_host(lo_d);
  const auto back = test::to_host(back_d);
  size_t bad_split = 0, bad_join = 0;
  for (size_t i = 0; i < n; ++i) {
    const am::MasterSplit want = am::split_master(x[i]);
    bad_split += hi[i].bits != want.hi || lo[i] != want.lo;
    const uint32_t got = bits(back[i]);
    bad_join += is_nan_bits(patterns[i]) ? !(is_nan_bits(got) && (got >> 31) == (patterns[i] >> 31))
                                         : got != patterns[i];
  }
  EXPECT_EQ(bad_split, 0u);
  EXPECT_EQ(bad_join, 0u);
}

TEST(GpuOptimizer, Bf16MomentConversionsMatchTheHost) {
  MOE_REQUIRE_GPU();
  const std::vector<uint32_t> patterns = bit_patterns();
  const size_t n = patterns.size();
  std::vector<float> x(n);
  std::memcpy(x.data(), patterns.data(), n * sizeof(float));
  auto x_d = test::to_device(x);
  auto rounded_d = test::poisoned<bf16>(n);
  cuda::round_to_bf16(rounded_d.data(), x_d.data(), static_cast<int64_t>(n), nullptr);
  auto wide_d = test::poisoned<float>(n);
  cuda::widen_bf16(wide_d.data(), rounded_d.data(), static_cast<int64_t>(n), nullptr);
  const auto rounded = test::to_host(rounded_d);
  const auto wide = test::to_host(wide_d);
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i)
    bad += rounded[i].bits != float_to_bf16(x[i]).bits || bits(wide[i]) != uint32_t{rounded[i].bits} << 16;
  EXPECT_EQ(bad, 0u);
}

// Ragged parameters: shorter than a chunk, exactly one, one element more, a few, and
// more than one norm block's worth (256 chunks); some without weight decay.
void make_params(ParameterStore<float>& params) {
  const int64_t C = am::kNormChunk;
  const int64_t sizes[] = {1, 15, C, C + 1, 3 * C + 7, 100003, 300 * C + 3, 24};
  for (size_t i = 0; i < std::size(sizes); ++i) {
    ParamSpec spec{"p" + std::to_string(i), Shape{sizes[i]}, Init::Normal, 0.3};
    spec.weight_decay = i % 3 != 1;
    params.add(spec);
  }
  params.allocate(11);
}

// Per parameter a different scale, so the norm sums terms of different sizes.
void fill_grads(ParameterStore<float>& params, int64_t step, double scale) {
  CounterRng rng(17, "optimizer_grads");
  for (int id = 0; id < params.size(); ++id) {
    const double s = scale * std::pow(3.0, id % 4 - 2);
    for (int64_t i = 0; i < params.numel(id); ++i)
      params.grad(id)[i] = static_cast<float>(s * rng.normal(static_cast<uint64_t>(step) << 40 | uint64_t(id) << 32 | uint64_t(i)));
  }
}

double cpu_norm(ParameterStore<float>& params) { return clip_gradients(params, 0.0, 0.0).global_norm; }

TEST(GpuOptimizer, GradNormIsTheCpuNormBitForBit) {
  MOE_REQUIRE_GPU();
  ParameterStore<float> params;
  make_params(params);
  GpuParameterStore gpu(params, MomentDtype::Fp32, {}, nullptr);
  GpuOptimizer optimizer(gpu, params, nullptr);
  for (int64_t step = 1; step <= 3; ++step) {
    fill_grads(params, step, step == 2 ? 1e3 : 1e-3);
    upload_grads(gpu, params);
    const double want = cpu_norm(params);
    const double got = optimizer.grad_norm();
    EXPECT_EQ(got, want) << "step " << step << ": relative difference " << (got - want) / want;
    EXPECT_EQ(optimizer.last_grad_norm(), want);
    EXPECT_FALSE(optimizer.last_step_skipped());
  }
  // An inf or a NaN anywhere makes the norm non-finite, and the step is skipped.
  params.grad(6)[123456] = std::numeric_limits<float>::infinity();
  upload_grads(gpu, params);
  EXPECT_EQ(optimizer.grad_norm(), std::numeric_limits<double>::infinity());
  EXPECT_TRUE(optimizer.last_step_skipped());
  params.grad(3)[am::kNormChunk] = std::numeric_limits<float>::quiet_NaN();
  upload_grads(gpu, params);
  EXPECT_TRUE(std::isnan(optimizer.grad_norm()));
  EXPECT_TRUE(optimizer.last_step_skipped());
}

// Parameters, moments, bf16 weights and fp32 copies of the GPU store against the CPU's.
void expect_state_matches(GpuParameterStore& gpu, ParameterStore<float>& cpu_params, AdamW& cpu,
                          const std::vector<int>& fp32_ids, const std::string& when) {
  SCOPED_TRACE(when);
  ParameterStore<float> holder;
  make_params(holder);
  std::vector<float> m, v;
  download_state(gpu, holder, m, v);
  ASSERT_EQ(m.size(), cpu.first_moment().size());
  size_t bad_p = 0, bad_m = 0, bad_v = 0, bad_hi = 0, first_bad = 0;
  size_t packed = 0;
  std::vector<bf16> hi(static_cast<size_t>(gpu.storage_numel()));
  MOE_CUDA_CHECK(cudaMemcpy(hi.data(), gpu.weights(), hi.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  for (int id = 0; id < cpu_params.size(); ++id)
    for (int64_t i = 0; i < cpu_params.numel(id); ++i, ++packed) {
      const float want = cpu_params.value(id)[i];
      if (bits(holder.value(id)[i]) != bits(want) && bad_p++ == 0) first_bad = packed;
      bad_m += bits(m[packed]) != bits(cpu.first_moment()[packed]);
      bad_v += bits(v[packed]) != bits(cpu.second_moment()[packed]);
      bad_hi += hi[static_cast<size_t>(cpu_params.offset(id) + i)].bits != am::split_master(want).hi;
    }
  EXPECT_EQ(bad_p, 0u) << "parameters differ, first at packed index " << first_bad;
  EXPECT_EQ(bad_m, 0u) << "first moments differ";
  EXPECT_EQ(bad_v, 0u) << "second moments differ";
  EXPECT_EQ(bad_hi, 0u) << "bf16 weights differ";
  for (int id : fp32_ids) {
    std::vector<float> copy(static_cast<size_t>(cpu_params.numel(id)));
    MOE_CUDA_CHECK(cudaMemcpy(copy.data(), gpu.fp32_copies().values(id), copy.size() * sizeof(float), cudaMemcpyDeviceToHost));
    EXPECT_TRUE(std::equal(copy.begin(), copy.end(), cpu_params.value(id), [](float a, float b) { return bits(a) == bits(b); }))
        << "fp32 copy of parameter " << id;
  }
}

class GpuMultiTensorAdamW : public ::testing::TestWithParam<MomentDtype> {
 protected:
  OptimizerConfig config() const {
    OptimizerConfig c;
    c.weight_decay = 0.1;
    c.state_dtype = GetParam();
    return c;
  }
};

// Steps alternate between gradients far above the clipping norm and far below it; the
// last one goes through grad_norm() + adamw_step() as the trainer calls them, then a step
// with a NaN gradient is skipped.
TEST_P(GpuMultiTensorAdamW, ClippedStepsMatchTheCpuBitForBit) {
  MOE_REQUIRE_GPU();
  ParameterStore<float> params;
  make_params(params);
  const OptimizerConfig oc = config();
  AdamW cpu(oc, params);
  const std::vector<int> fp32_ids = {1, 7};
  GpuParameterStore gpu(params, GetParam(), fp32_ids, nullptr);
  GpuOptimizer optimizer(gpu, params, nullptr);
  const double max_norm = 1.0;
  for (int64_t step = 1; step <= 5; ++step) {
    fill_grads(params, step, step % 2 == 0 ? 1.0 : 1e-5);
    upload_grads(gpu, params);  // before clip_gradients scales the CPU's in place
    const ClipStats clip = clip_gradients(params, max_norm, 0.0);
    EXPECT_EQ(clip.global_clipped, step % 2 == 0) << "step " << step;
    const double lr = 1e-3 * static_cast<double>(step);
    const AdamWStep hyper{lr, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, step};
    if (step < 5) {
      optimizer.clip_and_adamw_step(hyper, max_norm);
    } else {
      const double norm = optimizer.grad_norm();
      const double factor = norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
      optimizer.adamw_step(hyper, static_cast<float>(factor));
    }
    cpu.step(lr);
    EXPECT_EQ(optimizer.last_grad_norm(), clip.global_norm) << "step " << step;
    EXPECT_FALSE(optimizer.last_step_skipped());
    expect_state_matches(gpu, params, cpu, fp32_ids, "step " + std::to_string(step));
  }
  params.grad(4)[99] = std::numeric_limits<float>::quiet_NaN();
  upload_grads(gpu, params);
  optimizer.clip_and_adamw_step(AdamWStep{1e-2, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, 6}, max_norm);
  EXPECT_TRUE(optimizer.last_step_skipped());
  EXPECT_TRUE(std::isnan(optimizer.last_grad_norm()));
  expect_state_matches(gpu, params, cpu, fp32_ids, "after the skipped step");
}

// Blocks of 16 built to take each of the kernels' paths, against the CPU bit for bit over
// 3 unclipped steps: plain random gradients (the fast paths); one large value beside ones
// 10^7 smaller (sqrt(v)'s codes below e4m3's normals: the value-by-value encoder); every
// other gradient exactly 0 (m = v = 0: the square root's and the division's IEEE paths);
// gradients of 10^6 (sqrt(v) past the scale bytes the whole-block encoder covers).
TEST_P(GpuMultiTensorAdamW, BlocksOfEveryPathStepLikeTheCpu) {
  MOE_REQUIRE_GPU();
  ParameterStore<float> params;
  make_params(params);
  const OptimizerConfig oc = config();
  AdamW cpu(oc, params);
  GpuParameterStore gpu(params, GetParam(), {}, nullptr);
  GpuOptimizer optimizer(gpu, params, nullptr);
  CounterRng rng(23, "every path");
  for (int64_t step = 1; step <= 3; ++step) {
    for (int id = 0; id < params.size(); ++id)
      for (int64_t i = 0; i < params.numel(id); ++i) {
        const double g = rng.normal(static_cast<uint64_t>(step) << 40 | uint64_t(id) << 32 | uint64_t(i));
        const int64_t block = i / am::kMomentBlock;  // a parameter's blocks start at its first element
        const double scale = block % 4 == 1 ? (i % am::kMomentBlock == 0 ? 1.0 : 1e-7)
                             : block % 4 == 2 ? (i % 2 == 0 ? 0.0 : 1.0)
                             : block % 4 == 3 ? 1e6
                                              : 1.0;
        params.grad(id)[i] = static_cast<float>(scale * g);
      }
    upload_grads(gpu, params);
    const double lr = 1e-3;
    optimizer.clip_and_adamw_step(AdamWStep{lr, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, step}, 0.0);
    cpu.step(lr);
    EXPECT_FALSE(optimizer.last_step_skipped());
    expect_state_matches(gpu, params, cpu, {}, "step " + std::to_string(step));
  }
}

// Checkpoints: what upload_state() puts in, download_state() gives back (bf16 moments
// rounded to nearest even), edge values of the weights included.
TEST_P(GpuMultiTensorAdamW, StateRoundTrips) {
  MOE_REQUIRE_GPU();
  ParameterStore<float> initial, params;
  make_params(initial);
  make_params(params);
  GpuParameterStore gpu(initial, GetParam(), {0, 7}, nullptr);
  {  // the constructor's copy
    ParameterStore<float> holder;
    make_params(holder);
    download_params(gpu, holder);
    for (int id = 0; id < initial.size(); ++id)
      for (int64_t i = 0; i < initial.numel(id); ++i) ASSERT_EQ(bits(holder.value(id)[i]), bits(initial.value(id)[i]));
  }
  const float edges[] = {-0.0f, std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(),
                         std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                         std::numeric_limits<float>::infinity(), am::bits_float(0x3f808000u),
                         am::bits_float(0x007fffffu), am::bits_float(0xbf7fffffu)};
  for (size_t i = 0; i < std::size(edges); ++i) params.value(5)[i] = edges[i];
  params.value(0)[0] = -0.0f;
  const int64_t total = params.total_numel();
  std::vector<float> m(static_cast<size_t>(total)), v(static_cast<size_t>(total));
  CounterRng rng(5, "moments");
  for (int64_t i = 0; i < total; ++i) {
    m[static_cast<size_t>(i)] = static_cast<float>(1e-3 * rng.normal(static_cast<uint64_t>(2 * i)));
    v[static_cast<size_t>(i)] = static_cast<float>(1e-6 * std::abs(rng.normal(static_cast<uint64_t>(2 * i + 1))));
  }
  upload_state(gpu, params, m, v);
  ParameterStore<float> holder;
  make_params(holder);
  std::vector<float> m_back, v_back;
  download_state(gpu, holder, m_back, v_back);
  for (int id = 0; id < params.size(); ++id)
    for (int64_t i = 0; i < params.numel(id); ++i)
      ASSERT_EQ(bits(holder.value(id)[i]), bits(params.value(id)[i])) << params.spec(id).name << "[" << i << "]";
  const bool bf16 = GetParam() == MomentDtype::Bf16, fp8 = GetParam() == MomentDtype::Fp8;
  // What the store keeps: bf16 rounded; fp8 quantised per block of 16 from each
  // parameter's first element (m and v are in the checkpoint's packed layout).
  std::vector<float> want_m = m, want_v = v;
  for (int id = 0; id < params.size(); ++id) {
    int64_t at = 0;
    for (int j = 0; j < id; ++j) at += params.numel(j);
    for (int64_t b = 0; b < params.numel(id); b += am::kMomentBlock) {  // uploads round with step 0's bits
      const int len = static_cast<int>(std::min<int64_t>(am::kMomentBlock, params.numel(id) - b));
      for (int k = 0; k < len; ++k) {
        float& wm = want_m[static_cast<size_t>(at + b + k)];
        float& wv = want_v[static_cast<size_t>(at + b + k)];
        if (bf16) wm = bf16_to_float(float_to_bf16(wm)), wv = bf16_to_float(float_to_bf16(wv));
      }
      if (fp8) am::quantize_moment_block(want_m.data() + at + b, want_v.data() + at + b, len, params.offset(id) + b, 0);
    }
  }
  size_t bad = 0, changed = 0;
  for (int64_t i = 0; i < total; ++i) {
    const auto k = static_cast<size_t>(i);
    bad += bits(m_back[k]) != bits(want_m[k]) || bits(v_back[k]) != bits(want_v[k]);
    changed += bits(m_back[k]) != bits(m[k]);
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(changed > 0, bf16 || fp8);
  if (fp8) {  // stored fp8 values load back unchanged (a checkpoint reloads bit for bit)
    upload_state(gpu, params, m_back, v_back);
    std::vector<float> m_again, v_again;
    download_state(gpu, holder, m_again, v_again);
    EXPECT_EQ(m_again, m_back);
    EXPECT_EQ(v_again, v_back);
  }
  std::vector<float> copy(static_cast<size_t>(params.numel(7)));
  MOE_CUDA_CHECK(cudaMemcpy(copy.data(), gpu.fp32_copies().values(7), copy.size() * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::equal(copy.begin(), copy.end(), params.value(7)));
  // The store's size: the blocks and the fp32 copies (parameters 0 and 7, padded to 16).
  const auto blocks = static_cast<size_t>(static_cast<double>(gpu.storage_numel()) *
                                         GpuParameterStore::bytes_per_parameter(GetParam()));
  const size_t copies = static_cast<size_t>((params.numel(0) + 15) / 16 * 16 + (params.numel(7) + 15) / 16 * 16);
  // Each of the five blocks rounds up to whole chunks (core/cuda/resident_block.h, 2 MiB).
  EXPECT_GE(gpu.device_bytes() + 2, blocks + copies * sizeof(float));  // fp8: scale bytes a block, rounded up
  EXPECT_LE(gpu.device_bytes(), blocks + copies * sizeof(float) + 5 * (size_t{2} << 20) + 2);
  EXPECT_EQ(GpuParameterStore::bytes_per_parameter(GetParam()), bf16 ? 12.0 : fp8 ? 10.125 : 16.0);
}

// training.interleave_gate_up's store (GpuParameterStore::interleave_hi): w1 | w3's hi
// halves expert by expert, the rest in place. Against a plain store of the same values:
// the same norms, parameters and moments after clipped steps, through a state upload and a
// range's download, bit for bit; and the hi halves where HiInterleave::hi_offset puts them
// (so the kernel's and the store's runs follow the layout, not only each other).
TEST_P(GpuMultiTensorAdamW, InterleavedGateUpStepsLikeThePlainLayout) {
  MOE_REQUIRE_GPU();
  const int64_t C = am::kNormChunk, E = 3, per_expert = 2 * C;
  ParameterStore<float> params;
  params.add(ParamSpec{"before", Shape{C + 5}, Init::Normal, 0.3});
  params.add(ParamSpec{"w1", Shape{E, per_expert}, Init::Normal, 0.3});
  params.add(ParamSpec{"w3", Shape{E, per_expert}, Init::Normal, 0.3});
  params.add(ParamSpec{"after", Shape{24}, Init::Normal, 0.3});
  params.allocate(5);
  const HiInterleave pair{params.offset(1), E, per_expert};
  ASSERT_EQ(params.offset(2), pair.first + E * per_expert);
  GpuParameterStore plain(params, GetParam(), {}, nullptr), interleaved(params, GetParam(), {}, nullptr);
  interleaved.interleave_hi({pair});
  EXPECT_EQ(interleaved.hi_offset(pair.first + per_expert), pair.first + 2 * per_expert);  // w1_1 after w1_0 | w3_0
  GpuOptimizer a(plain, params, nullptr), b(interleaved, params, nullptr);
  const OptimizerConfig oc = config();
  for (int64_t step = 1; step <= 3; ++step) {
    fill_grads(params, step, step == 2 ? 1.0 : 1e-5);
    upload_grads(plain, params);
    upload_grads(interleaved, params);
    const AdamWStep hyper{1e-3 * static_cast<double>(step), oc.beta1, oc.beta2, oc.eps, oc.weight_decay, step};
    a.clip_and_adamw_step(hyper, 1.0);
    b.clip_and_adamw_step(hyper, 1.0);
    EXPECT_EQ(b.last_grad_norm(), a.last_grad_norm()) << "step " << step;
  }
  const auto state = [&](GpuParameterStore& store) {
    ParameterStore<float> holder = params;
    std::vector<float> m, v;
    download_state(store, holder, m, v);
    std::vector<float> all(holder.values_data(), holder.values_data() + holder.storage_numel());
    all.insert(all.end(), m.begin(), m.end());
    all.insert(all.end(), v.begin(), v.end());
    return all;
  };
  const std::vector<float> want = state(plain);
  const auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](float p, float q) { return bits(p) == bits(q); });
  };
  EXPECT_TRUE(same(state(interleaved), want)) << "the interleaved store stepped other values";
  std::vector<bf16> hi_plain(static_cast<size_t>(plain.storage_numel())), hi(hi_plain.size());
  MOE_CUDA_CHECK(cudaMemcpy(hi_plain.data(), plain.weights(), hi.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  MOE_CUDA_CHECK(cudaMemcpy(hi.data(), interleaved.weights(), hi.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  size_t misplaced = 0;
  for (int64_t i = 0; i < plain.storage_numel(); ++i) {
    const int64_t at = i >= pair.first && i < pair.end() ? pair.hi_offset(i) : i;
    misplaced += hi[static_cast<size_t>(at)].bits != hi_plain[static_cast<size_t>(i)].bits;
  }
  EXPECT_EQ(misplaced, 0u) << "hi halves away from HiInterleave::hi_offset";
  // A state uploaded into another interleaved store comes back; a range across the pair's
  // edge and its expert slices reads the plain store's values.
  ParameterStore<float> stepped = params;
  std::vector<float> m, v;
  download_state(plain, stepped, m, v);
  GpuParameterStore other(params, GetParam(), {}, nullptr);
  other.interleave_hi({pair});
  upload_state(other, stepped, m, v);
  EXPECT_TRUE(same(state(other), want)) << "upload_state into an interleaved store";
  const Range r{pair.first - 3, per_expert + C / 2 + 3};
  std::vector<float> got(static_cast<size_t>(r.count)), expected(got.size());
  download_range(plain, r, expected.data(), nullptr, nullptr);
  download_range(other, r, got.data(), nullptr, nullptr);
  EXPECT_TRUE(same(got, expected)) << "download_range across the interleaved pair";
  upload_range(other, r, expected.data(), nullptr, nullptr);
  EXPECT_TRUE(same(state(other), want)) << "upload_range across the interleaved pair";
}

ModelConfig small_model() {
  ModelConfig c;
  c.vocab_size = 384;
  c.dim = 128;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.seq_len = 64;
  c.first_dense_layers = 1;
  c.dense_hidden = 256;
  c.moe.n_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 128;
  c.moe.n_shared_experts = 1;
  return c;
}

// The whole model: the GPU's gradients, clipped and applied on the GPU, give the same
// weights as the CPU AdamW applied to those gradients.
TEST_P(GpuMultiTensorAdamW, TransformerStepsMatchTheCpuOptimizer) {
  MOE_REQUIRE_GPU();
  const ModelConfig c = small_model();
  const int64_t batch = 2;
  Transformer<float> initial(c, 3);
  GpuModelOptions options;
  options.moments = GetParam();
  GpuTransformer gpu(c, initial.params(), options);
  GpuOptimizer optimizer(gpu.parameters(), initial.params(), gpu.stream());
  gpu.plan(batch);
  Transformer<float> cpu(c, 3);  // the same initial weights; receives the GPU's gradients
  const OptimizerConfig oc = config();
  AdamW cpu_adamw(oc, cpu.params());
  std::vector<int32_t> inputs, targets;
  CounterRng rng(8, "tokens");
  for (int64_t i = 0; i < batch * c.seq_len; ++i) {
    inputs.push_back(static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[0] % c.vocab_size));
    targets.push_back(static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[1] % c.vocab_size));
  }
  const double max_norm = 1e-3;  // below any gradient norm here: every step clips
  double first_loss = 0, loss = 0;
  for (int64_t step = 1; step <= 3; ++step) {
    gpu.parameters().zero_grads();
    loss = gpu.forward(inputs.data(), targets.data()).total();
    ASSERT_TRUE(std::isfinite(loss));
    if (step == 1) first_loss = loss;
    gpu.backward(1.0);
    gpu.download_grads(cpu.params());
    const ClipStats clip = clip_gradients(cpu.params(), max_norm, 0.0);
    EXPECT_TRUE(clip.global_clipped);
    const double lr = 3e-3;
    optimizer.clip_and_adamw_step(AdamWStep{lr, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, step}, max_norm);
    cpu_adamw.step(lr);
    EXPECT_EQ(optimizer.last_grad_norm(), clip.global_norm) << "step " << step;
    Transformer<float> got(c, 3);
    gpu.download_params(got.params());
    size_t bad = 0;
    for (int id = 0; id < got.params().size(); ++id)
      for (int64_t i = 0; i < got.params().numel(id); ++i)
        bad += bits(got.params().value(id)[i]) != bits(cpu.params().value(id)[i]);
    EXPECT_EQ(bad, 0u) << "step " << step;
  }
  EXPECT_LT(loss, first_loss);
  EXPECT_GE(static_cast<double>(gpu.parameters().device_bytes()),
            static_cast<double>(initial.params().storage_numel()) * GpuParameterStore::bytes_per_parameter(GetParam()));
}

// A device block's bytes, element by element.
template <typename T>
std::vector<T> device_copy(const void* block, int64_t n) {
  std::vector<T> out(static_cast<size_t>(n));
  MOE_CUDA_CHECK(cudaMemcpy(out.data(), block, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

// ZeRO-1 (set_step_ranges): ranks that each step their plan's ranges leave, together, the
// whole store's step: inside a rank's update ranges its weights (hi and lo), moments and
// fp32 copies are the whole step's bits, outside them nothing moved; the ranks' norms'
// squares add up to the whole norm's square. (The pieces' NCCL sums run on 2+ GPUs.)
TEST_P(GpuMultiTensorAdamW, ShardedStepsAreTheWholeStepPieceByPiece) {
  MOE_REQUIRE_GPU();
  ParameterStore<float> params;
  make_params(params);
  const OptimizerConfig oc = config();
  const std::vector<int> fp32_ids = {1, 7};
  GpuParameterStore whole(params, GetParam(), fp32_ids, nullptr);
  GpuOptimizer whole_optimizer(whole, params, nullptr);
  const int64_t n = whole.storage_numel();
  // One stage per parameter (offsets are multiples of 16), buckets of ~3 norm chunks.
  std::vector<RangeList> stages;
  for (int id = 0; id < params.size(); ++id)
    stages.push_back({{params.offset(id), (id + 1 < params.size() ? params.offset(id + 1) : n) - params.offset(id)}});
  const int ranks = 3;
  std::vector<std::unique_ptr<GpuParameterStore>> shards;
  std::vector<std::unique_ptr<GpuOptimizer>> optimizers;
  std::vector<dist::ZeroShardPlan> plans;
  for (int r = 0; r < ranks; ++r) {
    plans.push_back(dist::plan_zero_shards(stages, whole.fp32_copies().ranges(), 3 * am::kNormChunk, ranks, r));
    shards.push_back(std::make_unique<GpuParameterStore>(params, GetParam(), fp32_ids, nullptr));
    optimizers.push_back(std::make_unique<GpuOptimizer>(*shards.back(), params, nullptr));
    optimizers.back()->set_step_ranges(plans.back().update, plans.back().norm);
  }
  const auto lo_before = device_copy<int16_t>(whole.weights_lo(), n);
  for (int64_t step = 1; step <= 3; ++step) {
    fill_grads(params, step, step == 2 ? 1.0 : 1e-4);
    upload_grads(whole, params);
    const double norm = whole_optimizer.grad_norm();
    double sum_sq = 0;
    for (int r = 0; r < ranks; ++r) {
      upload_grads(*shards[static_cast<size_t>(r)], params);
      const double part = optimizers[static_cast<size_t>(r)]->grad_norm();
      sum_sq += part * part;
    }
    EXPECT_NEAR(std::sqrt(sum_sq), norm, 1e-12 * norm) << "step " << step;
    const float grad_scale = norm > 1.0 ? static_cast<float>(1.0 / (norm + 1e-6)) : 1.0f;
    const AdamWStep hyper{1e-3, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, step};
    whole_optimizer.adamw_step(hyper, grad_scale);
    for (auto& optimizer : optimizers) optimizer->adamw_step(hyper, grad_scale);
  }
  const auto hi = device_copy<uint16_t>(whole.weights_hi(), n);
  const auto lo = device_copy<int16_t>(whole.weights_lo(), n);
  // The moments as fp32 over the whole block (the stored values: bf16 widened, fp8 decoded).
  const auto moments_of = [n](const GpuParameterStore& store) {
    std::vector<float> values(static_cast<size_t>(n)), mv(2 * static_cast<size_t>(n));
    download_range(store, {0, n}, values.data(), mv.data(), mv.data() + n);
    return mv;
  };
  const std::vector<float> mv = moments_of(whole);
  int64_t stepped_somewhere = 0;
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r);
    std::vector<char> mine(static_cast<size_t>(n), 0);
    for (const auto& [begin, count] : plans[static_cast<size_t>(r)].update)
      std::fill(mine.begin() + begin, mine.begin() + begin + count, 1);
    GpuParameterStore& shard = *shards[static_cast<size_t>(r)];
    const auto shard_hi = device_copy<uint16_t>(shard.weights_hi(), n);
    const auto shard_lo = device_copy<int16_t>(shard.weights_lo(), n);
    const std::vector<float> shard_mv = moments_of(shard);
    int64_t bad_mine = 0, bad_other = 0;
    for (int64_t e = 0; e < n; ++e) {
      const auto i = static_cast<size_t>(e);
      const bool moments_equal = bits(shard_mv[i]) == bits(mv[i]) &&
                                 bits(shard_mv[i + static_cast<size_t>(n)]) == bits(mv[i + static_cast<size_t>(n)]);
      if (mine[i]) {
        bad_mine += shard_hi[i] != hi[i] || shard_lo[i] != lo[i] || !moments_equal;
      } else {
        bad_other += shard_lo[i] != lo_before[i];  // never stepped: the initial weights
        stepped_somewhere += lo[i] != lo_before[i];
      }
    }
    EXPECT_EQ(bad_mine, 0) << "elements of this rank's ranges differ from the whole step";
    EXPECT_EQ(bad_other, 0) << "elements outside this rank's ranges were stepped";
    for (int id : fp32_ids)
      EXPECT_EQ(device_copy<uint32_t>(shard.fp32_copies().values(id), params.numel(id)),
                device_copy<uint32_t>(whole.fp32_copies().values(id), params.numel(id)))
          << "fp32 copy of parameter " << id;
  }
  EXPECT_GT(stepped_somewhere, n);  // each rank left most of the block to the others
  EXPECT_THROW(optimizers[0]->clip_and_adamw_step(AdamWStep{}, 1.0), Error);  // its norm is a part
  EXPECT_THROW(optimizers[0]->set_step_ranges({{64, 16}, {32, 16}}, {}), Error);  // unsorted
}

// ZeRO's packed state (pack_optimizer_state): ranks that keep the lo halves and moments of
// their plan's ranges only, back to back, step them to the whole store's bits; each holds
// about 1/N of that state, and what it does not hold is refused with one line.
TEST_P(GpuMultiTensorAdamW, PackedShardsStepAsTheWholeBlockAndHoldTheirPiecesOnly) {
  MOE_REQUIRE_GPU();
  ParameterStore<float> params;
  make_params(params);
  const OptimizerConfig oc = config();
  const std::vector<int> fp32_ids = {1, 7};
  GpuParameterStore whole(params, GetParam(), fp32_ids, nullptr);
  GpuOptimizer whole_optimizer(whole, params, nullptr);
  const int64_t n = whole.storage_numel();
  std::vector<RangeList> stages;
  for (int id = 0; id < params.size(); ++id)
    stages.push_back({{params.offset(id), (id + 1 < params.size() ? params.offset(id + 1) : n) - params.offset(id)}});
  const int ranks = 3;
  std::vector<std::unique_ptr<GpuParameterStore>> shards;
  std::vector<std::unique_ptr<GpuOptimizer>> optimizers;
  std::vector<dist::ZeroShardPlan> plans;
  for (int r = 0; r < ranks; ++r) {
    plans.push_back(dist::plan_zero_shards(stages, whole.fp32_copies().ranges(), 3 * am::kNormChunk, ranks, r));
    shards.push_back(std::make_unique<GpuParameterStore>(params, GetParam(), fp32_ids, nullptr));
    optimizers.push_back(std::make_unique<GpuOptimizer>(*shards.back(), params, nullptr));
    pack_optimizer_state(*shards.back(), plans.back().update);
    optimizers.back()->set_step_ranges(plans.back().update, plans.back().norm);
  }
  for (int64_t step = 1; step <= 3; ++step) {
    fill_grads(params, step, 1e-3);
    upload_grads(whole, params);
    const AdamWStep hyper{1e-3, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, step};
    whole_optimizer.adamw_step(hyper, 1.0f);
    for (int r = 0; r < ranks; ++r) {
      upload_grads(*shards[static_cast<size_t>(r)], params);
      optimizers[static_cast<size_t>(r)]->adamw_step(hyper, 1.0f);
    }
  }
  const size_t state_bytes = 2 + 2 * whole.moment_bytes();  // lo half and two moments per element
  int64_t owned_total = 0;
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r);
    GpuParameterStore& shard = *shards[static_cast<size_t>(r)];
    EXPECT_EQ(optimizer_ranges(shard), merge_ranges(plans[static_cast<size_t>(r)].update));
    int64_t owned = 0;
    for (const Range& range : optimizer_ranges(shard)) {
      std::vector<float> want(static_cast<size_t>(range.count) * 3), got(want.size());
      const auto c = static_cast<size_t>(range.count);
      download_range(whole, range, want.data(), want.data() + c, want.data() + 2 * c);
      download_range(shard, range, got.data(), got.data() + c, got.data() + 2 * c);
      EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
          << "range [" << range.offset << ", " << range.end() << ")";
      owned += range.count;
    }
    owned_total += owned;
    // hi halves and gradients whole, the rest for its ranges only (plus alignment, and the
    // packed blocks' last chunk each).
    const size_t held = shard.device_bytes(), full = whole.device_bytes();
    EXPECT_LT(held, full - static_cast<size_t>(n - owned - 16 * 64) * state_bytes + 3 * (size_t{2} << 20));
    EXPECT_THROW(shard.weights_lo(), Error);
    EXPECT_THROW(shard.moment_block(0), Error);
    const Range elsewhere = subtract_ranges({{0, n}}, optimizer_ranges(shard)).front();
    std::vector<float> out(static_cast<size_t>(elsewhere.count) * 3);
    EXPECT_THROW(download_range(shard, elsewhere, out.data(), nullptr, nullptr), Error);
    EXPECT_THROW(pack_optimizer_state(shard, plans[static_cast<size_t>(r)].update), Error);  // once
  }
  EXPECT_GE(owned_total, n - 16 * params.size());  // every element stepped somewhere (padding aside)
  // The lo block again for a gather: its own ranges filled from the packed halves.
  GpuParameterStore& shard = *shards[0];
  hold_master(shard, shard.resident_ranges());
  const auto lo_whole = device_copy<int16_t>(whole.weights_lo(), n);
  const auto lo_shard = device_copy<int16_t>(shard.weights_lo(), n);
  for (const Range& range : optimizer_ranges(shard))
    EXPECT_TRUE(std::equal(lo_whole.begin() + range.offset, lo_whole.begin() + range.end(), lo_shard.begin() + range.offset));
  hold_master(shard, {});
  EXPECT_THROW(shard.weights_lo(), Error);
}

INSTANTIATE_TEST_SUITE_P(Moments, GpuMultiTensorAdamW,
                         ::testing::Values(MomentDtype::Fp32, MomentDtype::Bf16, MomentDtype::Fp8),
                         [](const ::testing::TestParamInfo<MomentDtype>& info) {
                           return info.param == MomentDtype::Bf16  ? std::string("Bf16")
                                  : info.param == MomentDtype::Fp8 ? std::string("Fp8")
                                                                   : std::string("Fp32");
                         });

}  // namespace
}  // namespace moe
