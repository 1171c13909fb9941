// Helpers for GPU-vs-CPU kernel tests: bf16-rounded random inputs (so the CPU op sees
// exactly what the GPU sees), device round trips, poisoned outputs and a tolerance
// check in which NaN never passes.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/gpu.h"
#include "core/rng.h"
#include "config/run_config.h"

namespace moe::test {

#define MOE_REQUIRE_GPU()                                              \
  do {                                                                 \
    if (::moe::gpu::device_count() == 0) GTEST_SKIP() << "no GPU";     \
  } while (0)

// Normal(0, scale) values rounded to bf16 and back.
inline std::vector<float> random_bf16_floats(size_t n, uint64_t seed, const std::string& name,
                                             double scale = 1.0) {
  CounterRng rng(seed, name);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16_to_float(float_to_bf16(static_cast<float>(scale * rng.normal(i))));
  return v;
}

inline std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}

// Bitwise equal (memcmp: -0/+0 and NaN payloads count); empty vectors compare without
// touching their data() (null there).
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

inline std::vector<float> to_float(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
  return out;
}

template <typename T>
gpu::DeviceArray<T> to_device(const std::vector<T>& host) {
  gpu::DeviceArray<T> d(host.size());
  d.upload(host.data(), host.size());
  return d;
}

inline gpu::DeviceArray<bf16> to_device_bf16(const std::vector<float>& host) { return to_device(to_bf16(host)); }

// A device array filled with NaN bytes: a kernel that forgets an element fails the check.
template <typename T>
gpu::DeviceArray<T> poisoned(size_t n) {
  gpu::DeviceArray<T> d(n);
  d.fill_bytes(0xff);
  return d;
}

template <typename T>
std::vector<T> to_host(const gpu::DeviceArray<T>& d) {
  std::vector<T> host(d.size());
  d.download(host.data(), host.size());
  return host;
}

inline std::vector<float> to_host_float(const gpu::DeviceArray<bf16>& d) { return to_float(to_host(d)); }

// Every element within atol + rtol * |want|; NaN or Inf in `got` always fails.
inline void expect_close(const std::string& what, const std::vector<float>& got,
                         const std::vector<float>& want, double rtol, double atol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, worst_index = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    const double allowed = atol + rtol * std::abs(static_cast<double>(want[i]));
    const bool ok = std::isfinite(got[i]) && err <= allowed;
    if (!ok) ++bad;
    const double ratio = std::isfinite(got[i]) ? err / allowed : INFINITY;
    if (ratio > worst) {
      worst = ratio;
      worst_index = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements out of tolerance; worst at "
                     << worst_index << ": got " << got[worst_index] << " want " << want[worst_index];
}

// Expert offsets (E + 1) of rows per expert.
inline std::vector<int32_t> offsets_of(const std::vector<int32_t>& rows) {
  std::vector<int32_t> offsets(rows.size() + 1, 0);
  std::partial_sum(rows.begin(), rows.end(), offsets.begin() + 1);
  return offsets;
}

// Rows [first_row, rows) of a GEMM's output [.., ld], poisoned with 0xffff before, still
// hold the poison (rows past the last expert's are not the GEMM's).
inline void expect_rows_untouched(const std::vector<bf16>& got, int64_t first_row, int64_t rows, int64_t ld) {
  size_t changed = 0;
  for (int64_t r = first_row; r < rows; ++r)
    for (int64_t c = 0; c < ld; ++c) changed += got[static_cast<size_t>(r * ld + c)].bits != 0xffff;
  EXPECT_EQ(changed, 0u) << "rows past the last expert were written (from row " << first_row << ")";
}

// A 2-layer MoE run on the GPU (4 experts top-2, dim 128, 2 micro-batches of 8 x 64
// tokens per step) for trainer-level GPU tests; vocab 320 leaves room for the byte
// tokenizer, which checkpoints validate against.
inline RunConfig tiny_gpu_run(int64_t steps) {
  RunConfig config;
  ModelConfig& m = config.model;
  m.vocab_size = 320;
  m.dim = 128;
  m.n_layers = 2;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.seq_len = 64;
  m.moe.n_experts = 4;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 128;
  config.training.device = TrainingDevice::Cuda;
  config.training.micro_batch = 8;
  config.training.global_batch_tokens = 1024;  // 2 micro-batches
  config.training.steps = steps;
  config.training.val_interval = 0;
  config.lr.peak = 3e-3;
  config.lr.warmup_steps = 2;
  return config;
}

// bf16 keeps 8 significant bits: one rounding is a relative error up to 2^-8.
constexpr double kBf16Rtol = 1.0 / 128;

// ||got - want|| / ||want|| (L2 over every element; the sizes must agree).
inline double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace moe::test

namespace moe {
// The GPU tests call these helpers unqualified.
using test::expect_close;
using test::expect_rows_untouched;
using test::kBf16Rtol;
using test::offsets_of;
using test::poisoned;
using test::random_bf16_floats;
using test::same_bits;
using test::relative_l2;
using test::to_device;
using test::to_device_bf16;
using test::to_host;
using test::to_host_float;
}  // namespace moe
