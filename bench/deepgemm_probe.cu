// DeepGEMM's Hopper fp8 GEMM (sm90_fp8_gemm_1d2d_impl, from the PyPI wheel sgl-deep-gemm;
// bench/deepgemm_probe.sh fetches its headers and builds this) at mixtral-mini's expert and
// dense-projection GEMM shapes, before any wiring (docs/KERNEL_ROADMAP.md, "FP8: a grouped
// GEMM of DeepGEMM's class"): D [M, N] bf16 = A [M, K] e4m3 with 1 x 128 scales times B_g
// [N, K] e4m3 with 128 x 128 scales, the rows of expert g at [align(end[g - 1], 128), end[g])
// (one group: a dense GEMM).
// Checks sampled outputs against the host's fp64 sum of the dequantised inputs (the GEMM
// tests' tolerance: 2^-7 of the value + 2^-9 of the terms' magnitude), then times
// the kernel (CUDA events, 3 warm-up launches, the median of 20).
//   deepgemm_probe [ROWS=32768]    (8 experts; one H100/H200: 132 SMs)
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>

#include "deepgemm_probe_util.cuh"

namespace {

constexpr uint32_t kBlockM = 128, kBlockK = 128;
constexpr uint32_t kTmaThreads = 128, kMathThreads = 256;

using probe::device_copy;
using probe::kSms;
using probe::map_2d;

using Kernel = void (*)(float*, int*, uint32_t, uint32_t, uint32_t, const cute::TmaDescriptor,
                        const cute::TmaDescriptor, const cute::TmaDescriptor, const cute::TmaDescriptor);

// A tile shape and TMA multicast (a cluster of kMulticast CTAs sharing B's tile, or A's), for
// kGroups experts (the psum layout) or one dense GEMM (kGroups 1: GemmType::Normal).
template <uint32_t kGroups, uint32_t kBlockN, uint32_t kStages, uint32_t kMulticast, bool kMulticastOnA>
struct Config {
  static constexpr uint32_t kN = kBlockN, kStageCount = kStages, kCluster = kMulticast, kGroupCount = kGroups;
  static constexpr deep_gemm::GemmType kType =
      kGroups == 1 ? deep_gemm::GemmType::Normal : deep_gemm::GemmType::MGroupedContiguousWithPsumLayout;
  // D's TMA stores: the widest swizzle whose span (in bf16) divides the tile's N.
  static constexpr uint32_t kSwizzleD = kBlockN % 64 == 0 ? 128 : kBlockN % 32 == 0 ? 64 : 32;
  static constexpr Kernel kernel =
      &deep_gemm::sm90_fp8_gemm_1d2d_impl<cute::UMMA::Major::K, 0, 0, 0, kGroups, kBlockM, kBlockN, kBlockK, 128, 128,
                                          kSwizzleD, kStages, kTmaThreads, kMathThreads, kMulticast, kMulticastOnA, kSms,
                                          kType, cutlass::bfloat16_t, 128>;
  // The kernel's shared memory (its layout: the D tile, the stages' A and B and A scales,
  // the B scales of a whole K (two rows when a tile straddles two 128-blocks), barriers).
  static size_t smem_bytes(uint32_t K) {
    const size_t d = (kBlockM * kBlockN * 2 + 1023) / 1024 * 1024;
    const size_t ab = size_t{kStages} * (kBlockM + kBlockN) * kBlockK;
    const size_t sfa = size_t{kStages} * ((kBlockM * 4 + 127) / 128 * 128);
    const size_t sfb = (size_t{(K + 127) / 128} * (kBlockK % kBlockN == 0 ? 1 : 2) * 4 + 7) / 8 * 8;
    return d + ab + sfa + sfb + 2 * kStages * 8;
  }
  static const char* name() {
    static char text[64];
    std::snprintf(text, sizeof text, "BLOCK 128x%u, %u stages, multicast %u%s", kBlockN, kStages, kMulticast,
                  kMulticast > 1 ? (kMulticastOnA ? " on A" : " on B") : "");
    return text;
  }
};

float e4m3_to_float(uint8_t code) {
  __nv_fp8_e4m3 v;
  v.__x = code;
  return static_cast<float>(v);
}

struct Problem {
  uint32_t M = 0, N = 0, K = 0;
  std::vector<int> ends;  // group g's rows: [align(ends[g - 1], 128), ends[g])
  std::vector<uint8_t> a, b;
  std::vector<float> sfa, sfb;  // [K / 128][M] and [G][N / 128][K / 128]
};

Problem make_problem(uint32_t groups, uint32_t rows, uint32_t N, uint32_t K, std::mt19937& rng) {
  Problem p;
  p.N = N;
  p.K = K;
  // Uneven experts: +-40% around rows / G, one of them empty (one group: all the rows).
  std::uniform_real_distribution<double> share(0.6, 1.4);
  std::vector<double> w(groups, 1.0);
  for (uint32_t g = 0; g < groups && groups > 1; ++g) w[g] = g == 3 ? 0.0 : share(rng);
  double total = 0;
  for (double x : w) total += x;
  uint32_t start = 0;
  for (uint32_t g = 0; g < groups; ++g) {
    const auto n = static_cast<uint32_t>(rows * w[g] / total);
    p.ends.push_back(static_cast<int>(start + n));
    start = (start + n + kBlockM - 1) / kBlockM * kBlockM;
  }
  p.M = start;
  std::uniform_int_distribution<int> code(0, 0x7e);  // finite e4m3, both signs below
  std::uniform_int_distribution<int> sign(0, 1), exponent(-8, 0);
  p.a.resize(size_t{p.M} * K);
  p.b.resize(size_t{groups} * N * K);
  for (auto& c : p.a) c = static_cast<uint8_t>(code(rng) | (sign(rng) << 7));
  for (auto& c : p.b) c = static_cast<uint8_t>(code(rng) | (sign(rng) << 7));
  p.sfa.resize(size_t{K / 128} * p.M);
  p.sfb.resize(size_t{groups} * (N / 128) * (K / 128));
  for (auto& s : p.sfa) s = std::ldexp(1.0f, exponent(rng));
  for (auto& s : p.sfb) s = std::ldexp(1.0f, exponent(rng));
  return p;
}

// D[m][n] of expert g in fp64, and the sum of its terms' magnitudes (what an error is
// measured against: the sums of random signs can be near zero).
std::pair<double, double> reference(const Problem& p, uint32_t g, uint32_t m, uint32_t n) {
  double sum = 0, magnitude = 0;
  for (uint32_t k = 0; k < p.K; ++k) {
    const double a = e4m3_to_float(p.a[size_t{m} * p.K + k]) * p.sfa[size_t{k / 128} * p.M + m];
    const double b = e4m3_to_float(p.b[(size_t{g} * p.N + n) * p.K + k]) *
                     p.sfb[(size_t{g} * (p.N / 128) + n / 128) * (p.K / 128) + k / 128];
    sum += a * b;
    magnitude += std::fabs(a * b);
  }
  return {sum, magnitude};
}

template <typename C>
void run(const Problem& p, const char* what, std::mt19937& rng) {
  const uint32_t N = p.N, K = p.K;
  std::fprintf(stderr, "deepgemm_probe: %s, %s\n", what, C::name());
  uint32_t rows = 0, first_row = 0;  // the rows computed, not the padding
  for (const int end : p.ends) {
    rows += static_cast<uint32_t>(end) - first_row;
    first_row = (static_cast<uint32_t>(end) + kBlockM - 1) / kBlockM * kBlockM;
  }
  uint8_t* a = device_copy(p.a);
  uint8_t* b = device_copy(p.b);
  float* sfa = device_copy(p.sfa);
  float* sfb = device_copy(p.sfb);
  int* ends = device_copy(p.ends);
  __nv_bfloat16* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, size_t{p.M} * N * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMemset(d, 0xff, size_t{p.M} * N * sizeof(__nv_bfloat16)));
  const CUtensorMap map_a = map_2d(CU_TENSOR_MAP_DATA_TYPE_UINT8, a, K, p.M, K, kBlockK, kBlockM,
                                   CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap map_b = map_2d(CU_TENSOR_MAP_DATA_TYPE_UINT8, b, K, uint64_t{C::kGroupCount} * N, K, kBlockK, C::kN,
                                   CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap map_d = map_2d(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, d, N, p.M, uint64_t{N} * 2, C::kSwizzleD / 2,
                                   kBlockM,
                                   C::kSwizzleD == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                   : C::kSwizzleD == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                        : CU_TENSOR_MAP_SWIZZLE_32B);
  const CUtensorMap map_sfa = map_2d(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, sfa, p.M, K / 128, uint64_t{p.M} * 4, kBlockM,
                                     1, CU_TENSOR_MAP_SWIZZLE_NONE);
  const size_t smem = C::smem_bytes(K);
  CHECK_CUDA(cudaFuncSetAttribute(C::kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  uint32_t M = p.M;
  auto launch = [&] {
    probe::launch(C::kernel, kMathThreads, C::kCluster, smem, sfb, ends, M, N, K, map_a, map_b, map_d, map_sfa);
  };
  launch();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> out(size_t{p.M} * N);
  CHECK_CUDA(cudaMemcpy(out.data(), d, out.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
  // Sampled outputs of every non-empty expert against the host.
  double worst = 0, worst_share = 0;  // of the tolerance; of the terms' magnitude
  int checked = 0;
  std::uniform_int_distribution<uint32_t> col(0, N - 1);
  uint32_t first = 0;
  for (uint32_t g = 0; g < C::kGroupCount; ++g) {
    const auto end = static_cast<uint32_t>(p.ends[g]);
    for (int s = 0; s < 16 && end > first; ++s) {
      const uint32_t m = first + (s * 7919u) % (end - first), n = col(rng);
      const auto [want, magnitude] = reference(p, g, m, n);
      const double got = static_cast<float>(out[size_t{m} * N + n]);
      // The GEMM tests' tolerance (tests/gpu/fp8_gemm_test_util.h, expect_gemm_close): the
      // bf16 output's rounding with room, plus 2^-9 of the terms' magnitude for the fp8
      // tensor cores' partial sums.
      const double allowed = std::ldexp(std::fabs(want), -7) + std::ldexp(magnitude, -9);
      worst = std::max(worst, std::fabs(got - want) / allowed);
      worst_share = std::max(worst_share, std::fabs(got - want) / magnitude);
      ++checked;
    }
    first = (end + kBlockM - 1) / kBlockM * kBlockM;
  }
  const double median = probe::median_ms(launch);
  const double flops = 2.0 * rows * N * K;
  std::printf("%-26s %-36s rows %u (padded %u) N %u K %u: %.3f ms, %.0f TFLOP/s; %d sampled outputs, worst "
              "error %.1e of the terms' magnitude, %.2f of the tolerance: %s\n",
              what, C::name(), rows, p.M, N, K, median, flops / median / 1e9, checked, worst_share, worst,
              worst <= 1 ? "ok" : "MISMATCH");
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(sfa));
  CHECK_CUDA(cudaFree(sfb));
  CHECK_CUDA(cudaFree(ends));
  CHECK_CUDA(cudaFree(d));
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t rows = argc > 1 ? static_cast<uint32_t>(std::atoi(argv[1])) : 32768;
  probe::check_device_sms();
  std::mt19937 rng(7);
  // mixtral-mini's expert GEMMs (dim 2048, expert_hidden 5632, 8 experts, 32768 rows a layer).
  // The two shapes of a layer's four forward and data-gradient GEMMs, in a few tile shapes.
  for (const auto [N, K, what] : {std::tuple<uint32_t, uint32_t, const char*>{5632, 2048, "gate, up fwd; down dgrad"},
                                  {2048, 5632, "down fwd; gate, up dgrad"}}) {
    const Problem p = make_problem(8, rows, N, K, rng);
    run<Config<8, 128, 5, 1, false>>(p, what, rng);
    run<Config<8, 128, 5, 2, false>>(p, what, rng);
    // A cluster's two CTAs take consecutive tiles: with an odd count of N tiles (2048 / 160:
    // 13) a pair can straddle two experts or the last tile, and the kernel waits forever for
    // the missing peer; multicast only where the count is even.
    if ((N + 159) / 160 % 2 == 0) {
      run<Config<8, 160, 4, 2, false>>(p, what, rng);
    } else {
      run<Config<8, 160, 4, 1, false>>(p, what, rng);
    }
  }
  // Dense GEMMs: the projections (16384 tokens, dim 2048, q|k|v 4096), forward and data
  // gradient; and one expert's weight gradient as a plain GEMM over its 4,224 padded tokens
  // (33,792 / 8; A = dy's token columns with 1 x 128 scales along the tokens, B = x's or
  // act's with 128 x 128 blocks): dW1 or dW3 [F, D] and dW2 [D, F], 24 such a layer.
  for (const auto [M, N, K, what] :
       {std::tuple<uint32_t, uint32_t, uint32_t, const char*>{16384, 4096, 2048, "dense q|k|v fwd"},
        {16384, 2048, 4096, "dense q|k|v dgrad"},
        {16384, 2048, 2048, "dense output proj fwd, dgrad"},
        {5632, 2048, 4224, "one expert's dW1 (or dW3)"},
        {2048, 5632, 4224, "one expert's dW2"}}) {
    const Problem p = make_problem(1, M, N, K, rng);
    run<Config<1, 128, 5, 1, false>>(p, what, rng);
    run<Config<1, 128, 5, 2, false>>(p, what, rng);
  }
  return 0;
}
