#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <vector>

#include "core/arena.h"
#include "core/bf16.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "core/threads.h"
#include "core/zeroed_allocator.h"
#include "kernels/matmul.h"

namespace moe {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly halfway between bf16 1.0 and 1 + 2^-7: ties go to even (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + 1.0f / 256).bits, float_to_bf16(1.0f).bits);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes up.
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64);
  // Just above halfway rounds up.
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256 + 1.0f / 4096)), 1.0f + 1.0f / 128);
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity()))));
  // The largest finite float rounds to infinity in bf16 (it is past bf16's max + half ulp).
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::max()))));
}

// Resident pages of this process (Linux /proc/self/statm), in bytes.
int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  statm >> size_pages >> resident_pages;
  return resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

// A ZeroedAllocator block reads as zeros and costs no resident memory until written: the
// host gradient block of a GPU run (every rank of a launch) is never committed.
TEST(ZeroedAllocator, ResizeReadsZerosAndCommitsNothingUntilWritten) {
  constexpr size_t kBytes = size_t{512} << 20;
  const int64_t before = resident_bytes();
  std::vector<float, ZeroedAllocator<float>> block;
  block.resize(kBytes / sizeof(float));
  const int64_t after_resize = resident_bytes();
  EXPECT_LT(after_resize - before, int64_t{64} << 20) << "resize touched the pages";
  for (size_t i = 0; i < block.size(); i += 4096) ASSERT_EQ(block[i], 0.0f);  // a read maps the shared zero page
  for (size_t i = 0; i < block.size(); i += 1024) block[i] = 1.0f;           // a write per page commits it
  EXPECT_GT(resident_bytes() - before, int64_t{256} << 20) << "the measurement sees committed pages";
  block.push_back(2.0f);  // growing copies values like any vector
  EXPECT_EQ(block[0], 1.0f);
  EXPECT_EQ(block[1], 0.0f);
  EXPECT_EQ(block.back(), 2.0f);
}

TEST(Tensor, ViewsShareMemory) {
  std::vector<float> storage(24);
  for (size_t i = 0; i < storage.size(); ++i) storage[i] = static_cast<float>(i);
  Tensor t(storage.data(), DType::F32, Shape{2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.select(1).ptr<float>()[0], 12.0f);
  EXPECT_EQ(t.slice(1, 2).shape(), (Shape{1, 3, 4}));
  EXPECT_EQ(t.reshape(Shape{6, 4}).select(5).ptr<float>()[3], 23.0f);
  EXPECT_THROW(t.ptr<int32_t>(), Error);
  EXPECT_THROW(t.reshape(Shape{5, 5}), Error);
  EXPECT_THROW((Shape{1, 2, 3, 4, 5}), Error);
}

TEST(Arena, MeasureThenAllocate) {
  auto plan = [](Arena& arena) {
    Tensor a = arena.alloc(DType::F32, Shape{10, 3});
    Tensor b = arena.alloc(DType::BF16, Shape{7});
    Tensor c = arena.alloc(DType::I64, Shape{2, 2});
    return std::vector<Tensor>{a, b, c};
  };
  Arena measure = Arena::measuring("test");
  plan(measure);
  Arena real("test", measure.high_water());
  auto views = plan(real);
  EXPECT_EQ(real.used(), measure.high_water());
  for (auto& v : views) EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % Arena::kAlignment, 0u);
  EXPECT_THROW(real.alloc(DType::F32, Shape{1}), Error);  // the plan is exact: no room left
}

TEST(Rng, KeyedByNameAndIndexOnly) {
  CounterRng a(42, "layers.0.attn.wq"), b(42, "layers.0.attn.wq"), c(42, "layers.0.attn.wk"),
      d(43, "layers.0.attn.wq");
  EXPECT_EQ(a.normal(17), b.normal(17));
  EXPECT_NE(a.normal(17), c.normal(17));
  EXPECT_NE(a.normal(17), d.normal(17));
  // Moments of the normal generator over many draws.
  double sum = 0, sum_sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double x = a.normal(static_cast<uint64_t>(i));
    sum += x;
    sum_sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum_sq / n, 1.0, 0.01);
}

// Philox4x32-10's known-answer vectors (Random123's kat_vectors): the generator is the
// standard one, all ten rounds of it.
TEST(Rng, Philox4x32KnownAnswers) {
  using Words = std::array<uint32_t, 4>;
  EXPECT_EQ(philox4x32({0, 0, 0, 0}, {0, 0}), (Words{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}),
            (Words{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
            (Words{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Rng, FillIndependentOfThreadCount) {
  std::vector<float> one(5000), two(5000);
  set_num_threads(1);
  fill_normal(one.data(), 5000, 7, "w", 0.02);
  set_num_threads(2);
  fill_normal(two.data(), 5000, 7, "w", 0.02);
  EXPECT_EQ(one, two);
}

TEST(Matmul, MatchesNaiveAndThreadCountInvariant) {
  const int64_t M = 300, N = 520, K = 77;
  std::vector<double> a(M * K), b(N * K), c(M * N);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::sin(0.1 * static_cast<double>(i));
  for (size_t i = 0; i < b.size(); ++i) b[i] = std::cos(0.07 * static_cast<double>(i));
  linear_forward(c.data(), a.data(), b.data(), static_cast<const double*>(nullptr), M, K, N);
  for (int64_t i = 0; i < M; i += 37)
    for (int64_t j = 0; j < N; j += 41) {
      double ref = 0;
      for (int64_t k = 0; k < K; ++k) ref += a[i * K + k] * b[j * K + k];
      EXPECT_NEAR(c[i * N + j], ref, 1e-10);
    }
  std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end()), c1(M * N), c2(M * N);
  std::vector<float> dw1(N * K), dw2(N * K);
  set_num_threads(1);
  linear_forward(c1.data(), af.data(), bf.data(), static_cast<const float*>(nullptr), M, K, N);
  linear_backward<float>(nullptr, dw1.data(), nullptr, c1.data(), af.data(), bf.data(), M, K, N);
  set_num_threads(2);
  linear_forward(c2.data(), af.data(), bf.data(), static_cast<const float*>(nullptr), M, K, N);
  linear_backward<float>(nullptr, dw2.data(), nullptr, c2.data(), af.data(), bf.data(), M, K, N);
  EXPECT_EQ(c1, c2);
  EXPECT_EQ(dw1, dw2);
}

}  // namespace
}  // namespace moe
