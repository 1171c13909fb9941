// The multi-tensor AdamW kernels called directly (cuda::grad_norm, cuda::multi_tensor_adamw),
// against adamw_math's host functions bit for bit: segments GpuParameterStore never makes
// and a bf16 moment group holding a NaN. The optimizer through the store is
// test_gpu_optimizer.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/rng.h"
#include "gpu_test_util.h"
#include "kernels/adamw_math.h"
#include "kernels/gpu_ops.h"
#include "optim/gpu_ops.h"
#include "optim/grad_clip.h"

namespace moe {
namespace {

namespace am = adamw_math;

uint32_t bits(float x) { return am::float_bits(x); }

// Random AdamW inputs for n elements, element i drawn at key (base | i); the moments
// rounded to bf16 when they are to be stored so.
struct AdamWInputs {
  std::vector<float> grads, weights, m, v;
};
AdamWInputs random_adamw_inputs(CounterRng& rng, size_t n, uint64_t base, bool bf16_moments) {
  AdamWInputs in{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (size_t i = 0; i < n; ++i) {
    const uint64_t key = base | i;
    in.grads[i] = static_cast<float>(rng.normal(key << 2 | 0));
    in.weights[i] = static_cast<float>(0.3 * rng.normal(key << 2 | 1));
    in.m[i] = static_cast<float>(0.01 * rng.normal(key << 2 | 2));
    in.v[i] = static_cast<float>(1e-4 * rng.uniform(key << 2 | 3));
    if (bf16_moments) in.m[i] = am::round_to_bf16(in.m[i]), in.v[i] = am::round_to_bf16(in.v[i]);
  }
  return in;
}

// The GPU's form of fp32 weights: bf16 hi halves and lo remainders (am::split_master).
void split_weights(const std::vector<float>& weights, std::vector<bf16>& hi, std::vector<int16_t>& lo) {
  hi.resize(weights.size());
  lo.resize(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    const am::MasterSplit split = am::split_master(weights[i]);
    hi[i].bits = split.hi;
    lo[i] = split.lo;
  }
}

// The kernels directly, on segments GpuParameterStore never makes (it starts every
// parameter on a 16-element boundary): offsets of every residue mod 8 and lengths that
// are no multiple of 4 or 8, so the element-wise heads and tails around the 16-byte
// vectors run; empty segments; over a thousand segments for the chunk -> segment search;
// fp32 copies at odd places; and base pointers off the 16-byte boundary (shift 1), where
// every access is one element. Elements outside the segments must stay as they were.
TEST(GpuOptimizer, KernelsOnUnalignedSegmentsMatchTheHost) {
  MOE_REQUIRE_GPU();
  const int64_t C = am::kNormChunk;
  CounterRng rng(5, "unaligned_segments");
  std::vector<cuda::OptimizerSegment> segments;
  int64_t end = 0, n_chunks = 0, mirror_numel = 0;
  auto add = [&](int64_t gap, int64_t numel, bool mirror) {
    cuda::OptimizerSegment seg;
    seg.offset = end + gap;
    seg.numel = numel;
    seg.first_chunk = n_chunks;
    seg.decay = segments.size() % 3 != 1;
    if (mirror) {
      seg.mirror_offset = mirror_numel;
      mirror_numel += numel + static_cast<int64_t>(segments.size() % 5);
    }
    segments.push_back(seg);
    end = seg.offset + numel;
    n_chunks += (numel + C - 1) / C;
  };
  add(4, 13, true);
  add(0, 0, false);
  add(3, C + 5, true);
  add(1, 2 * C + 3, false);
  for (int i = 0; i < 1100; ++i)
    add(i % 7, static_cast<int64_t>(rng.bits(static_cast<uint64_t>(i))[0] % 41), i % 97 == 0);
  add(5, 3 * C + 9, true);
  add(0, 0, false);  // empty, at the very end
  const int64_t storage = end + 6;
  const auto n_segments = static_cast<int64_t>(segments.size());
  const double max_norm = 1.0;

  for (const bool bf16_moments : {false, true}) {
    for (const int64_t shift : {int64_t{0}, int64_t{1}}) {
      SCOPED_TRACE(std::string(bf16_moments ? "bf16" : "fp32") + " moments, shift " + std::to_string(shift));
      const auto n = static_cast<size_t>(storage + shift);
      auto [grads, weights, m, v] = random_adamw_inputs(rng, n, uint64_t(shift) << 40, bf16_moments);
      std::vector<bf16> hi;
      std::vector<int16_t> lo;
      split_weights(weights, hi, lo);
      auto hi_d = test::to_device(hi);
      auto lo_d = test::to_device(lo);
      auto grads_d = test::to_device(grads);
      auto m32_d = test::to_device(m);  // both kinds, the kernel uses one
      auto v32_d = test::to_device(v);
      auto m16_d = test::to_device(test::to_bf16(m));
      auto v16_d = test::to_device(test::to_bf16(v));
      auto mirror_d = test::poisoned<float>(static_cast<size_t>(mirror_numel + shift));
      auto segments_d = test::to_device(segments);
      gpu::DeviceArray<double> chunk_sq_d(static_cast<size_t>(n_chunks)), segment_sq_d(segments.size());
      am::AdamWScalars s = am::adamw_step_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
      auto scalars_d = test::to_device(std::vector<am::AdamWScalars>{s});
      void* m_d = bf16_moments ? static_cast<void*>(m16_d.data() + shift) : static_cast<void*>(m32_d.data() + shift);
      void* v_d = bf16_moments ? static_cast<void*>(v16_d.data() + shift) : static_cast<void*>(v32_d.data() + shift);
      cuda::grad_norm(scalars_d.data(), chunk_sq_d.data(), segment_sq_d.data(), grads_d.data() + shift,
                      segments_d.data(), n_segments, n_chunks, max_norm, nullptr);
      cuda::multi_tensor_adamw(hi_d.data() + shift, lo_d.data() + shift, mirror_d.data() + shift,
                               grads_d.data() + shift,
                               {m_d, v_d, nullptr, nullptr, bf16_moments ? MomentDtype::Bf16 : MomentDtype::Fp32},
                               segments_d.data(), n_segments, n_chunks, scalars_d.data(), nullptr);

      // The norm as the CPU sums it: per segment sum_of_squares, then the segments in order.
      double sq = 0;
      for (const auto& seg : segments) sq += sum_of_squares(grads.data() + shift + seg.offset, seg.numel);
      const double norm = std::sqrt(sq);
      ASSERT_GT(norm, max_norm);  // the step clips
      const am::AdamWScalars got_scalars = test::to_host(scalars_d)[0];
      EXPECT_EQ(got_scalars.norm, norm);
      s.grad_scale = static_cast<float>(max_norm / (norm + 1e-6));
      EXPECT_EQ(bits(got_scalars.grad_scale), bits(s.grad_scale));
      EXPECT_EQ(got_scalars.skip, 0);

      std::vector<float> want_mirror(static_cast<size_t>(mirror_numel + shift), 0.0f);
      std::vector<bool> mirrored(want_mirror.size(), false);
      for (const auto& seg : segments)
        for (int64_t k = 0; k < seg.numel; ++k) {
          const auto i = static_cast<size_t>(shift + seg.offset + k);
          weights[i] = am::adamw_update(weights[i], grads[i], m[i], v[i], s, seg.decay ? s.decay_factor : 1.0f,
                                        bf16_moments);
          if (seg.mirror_offset >= 0) {
            const auto at = static_cast<size_t>(shift + seg.mirror_offset + k);
            want_mirror[at] = weights[i];
            mirrored[at] = true;
          }
        }
      const auto got_hi = test::to_host(hi_d);
      const auto got_lo = test::to_host(lo_d);
      const auto got_m = bf16_moments ? test::to_float(test::to_host(m16_d)) : test::to_host(m32_d);
      const auto got_v = bf16_moments ? test::to_float(test::to_host(v16_d)) : test::to_host(v32_d);
      const auto got_mirror = test::to_host(mirror_d);
      size_t bad_weights = 0, bad_moments = 0, bad_mirror = 0;
      for (size_t i = 0; i < n; ++i) {
        const am::MasterSplit want = am::split_master(weights[i]);
        bad_weights += got_hi[i].bits != want.hi || got_lo[i] != want.lo;
        bad_moments += bits(got_m[i]) != bits(m[i]) || bits(got_v[i]) != bits(v[i]);
      }
      for (size_t i = 0; i < want_mirror.size(); ++i)
        bad_mirror += mirrored[i] ? bits(got_mirror[i]) != bits(want_mirror[i]) : bits(got_mirror[i]) != 0xffffffffu;
      EXPECT_EQ(bad_weights, 0u);
      EXPECT_EQ(bad_moments, 0u);
      EXPECT_EQ(bad_mirror, 0u);
    }
  }
}

// bf16 moments are rounded by the hardware's convert, except in a group of 8 that holds a
// NaN, which takes the integer path (multi_tensor_adamw.cu, round_moments8_to_bf16): that
// group's other elements still get the CPU's bits, and the NaN stays a NaN.
TEST(GpuOptimizer, Bf16MomentGroupWithANanRoundsItsOtherElementsLikeTheHost) {
  MOE_REQUIRE_GPU();
  const int64_t n = 64, nan_at = 9;  // the second group of 8
  CounterRng rng(13, "nan_moment_group");
  auto [grads, weights, m, v] = random_adamw_inputs(rng, static_cast<size_t>(n), 0, true);
  m[nan_at] = std::numeric_limits<float>::quiet_NaN();
  std::vector<bf16> hi;
  std::vector<int16_t> lo;
  split_weights(weights, hi, lo);
  cuda::OptimizerSegment seg;
  seg.offset = 0;
  seg.numel = n;
  seg.first_chunk = 0;
  seg.decay = true;
  auto hi_d = test::to_device(hi);
  auto lo_d = test::to_device(lo);
  auto grads_d = test::to_device(grads);
  auto m_d = test::to_device(test::to_bf16(m));
  auto v_d = test::to_device(test::to_bf16(v));
  auto segments_d = test::to_device(std::vector<cuda::OptimizerSegment>{seg});
  const am::AdamWScalars s = am::adamw_step_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
  auto scalars_d = test::to_device(std::vector<am::AdamWScalars>{s});
  cuda::multi_tensor_adamw(hi_d.data(), lo_d.data(), nullptr, grads_d.data(),
                           {m_d.data(), v_d.data(), nullptr, nullptr, MomentDtype::Bf16}, segments_d.data(), 1, 1,
                           scalars_d.data(), nullptr);
  const auto got_hi = test::to_host(hi_d);
  const auto got_lo = test::to_host(lo_d);
  const auto got_m = test::to_float(test::to_host(m_d));
  const auto got_v = test::to_float(test::to_host(v_d));
  size_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float p = am::adamw_update(weights[i], grads[i], m[i], v[i], s, s.decay_factor, true);
    const am::MasterSplit want = am::split_master(p);
    if (i == nan_at) {  // NaN payloads differ between the CPU's and the GPU's arithmetic
      EXPECT_TRUE(std::isnan(got_m[i]));
      EXPECT_TRUE(std::isnan(am::join_master(got_hi[i].bits, got_lo[i])));
      EXPECT_EQ(bits(got_v[i]), bits(v[i]));
      continue;
    }
    bad += got_hi[i].bits != want.hi || got_lo[i] != want.lo || bits(got_m[i]) != bits(m[i]) ||
           bits(got_v[i]) != bits(v[i]);
  }
  EXPECT_EQ(bad, 0u);
}

}  // namespace
}  // namespace moe
