// DeepGEMM's Hopper bf16 GEMM (sm90_bf16_gemm_impl, PyPI sgl-deep-gemm's headers;
// bench/deepgemm_probe.sh builds this) at olmoe-mini's and mixtral-mini's expert GEMM shapes,
// before any wiring: can it beat our CUTLASS grouped GEMMs (577-596 TFLOP/s at olmoe-mini's
// shapes, cuBLAS's dense 656; BENCHMARKS.md "olmoe-mini kernel by kernel")?
//  - forward and data gradient: the m-grouped "psum" layout, D [R, N] = A [R, K] @ B_g, the
//    rows of expert g at [align(end[g - 1], 128), end[g]); B_g as our weights are stored:
//    [N, K] (K-major: gate|up's and down's forward) or [K, N] (MN-major: the data gradients);
//  - weight gradient: the k-grouped layout (each group's K its padded row count: the bf16
//    kernel takes MN-major A only there, not in the psum form), D_g [M, N] = A_g^T B_g with
//    A [R, M] and B [R, N] the expert rows themselves (MN-major: no transposed copies), bf16
//    D, no accumulation (an empty expert's D is not written: the caller zeroes it).
// Every expert's padding rows are zero, as the padded dispatch leaves them (the weight
// gradient sums them).
// Checks sampled outputs against the host's fp64 sums (tolerance 2^-7 of the value + 2^-14
// of the terms' magnitude: bf16's rounding and fp32 accumulation), then times the kernel
// (CUDA events, 3 warm-up launches, the median of 20).
//   deepgemm_bf16_probe [olmoe|mixtral|both]    (one H100/H200: 132 SMs)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <deep_gemm/impls/sm90_bf16_gemm.cuh>

#include "deepgemm_probe_util.cuh"

namespace {

using deep_gemm::GemmType;
using Major = cute::UMMA::Major;
using probe::map_2d;

constexpr uint32_t kRowAlign = 128;  // the padded dispatch's, and the psum layouts' alignment
constexpr uint32_t kBlockK = 64;     // 128-byte swizzled bf16 K-major tiles

using Kernel = void (*)(int*, uint32_t, uint32_t, uint32_t, const cute::TmaDescriptor, const cute::TmaDescriptor,
                        const cute::TmaDescriptor);

// kGroups: the compiled group count, the experts' (a CTA walks every compiled group before
// it exits: no empty ones).
template <uint32_t kGroups, Major kMajorB, GemmType kType, uint32_t kBlockM, uint32_t kBlockN, uint32_t kStages,
          uint32_t kMulticast>
struct Config {
  static constexpr Major kMajorA = kType == GemmType::KGroupedContiguous ? Major::MN : Major::K;
  static constexpr uint32_t kM = kBlockM, kN = kBlockN, kCluster = kMulticast;
  static constexpr uint32_t kMathThreads = 256;  // two warp groups of 64 rows (x2 waves at BLOCK_M 256)
  static constexpr Kernel kernel =
      &deep_gemm::sm90_bf16_gemm_impl<kMajorA, kMajorB, 0, 0, 0, kGroups, kBlockM, kBlockN, kBlockK, 128, 128, 128,
                                      kStages, 128, kMathThreads, kMulticast, false, probe::kSms, kType, false,
                                      cutlass::bfloat16_t>;
  // D's tile, the stages' A and B tiles, two barriers a stage.
  static size_t smem_bytes() {
    return (size_t{kBlockM} * kBlockN * 2 + 1023) / 1024 * 1024 + size_t{kStages} * (kBlockM + kBlockN) * kBlockK * 2 +
           2 * kStages * 8;
  }
  static std::string name() {
    char text[64];
    std::snprintf(text, sizeof text, "%ux%ux%u, %u stages%s", kBlockM, kBlockN, kBlockK, kStages,
                  kMulticast > 1 ? ", 2-CTA clusters sharing B" : "");
    return text;
  }
};

// Fast uniform bf16 values in [-1, 1) for the bulk operands.
struct Random {
  uint64_t state;
  explicit Random(uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 1) {}
  float next() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<float>(state >> 40) / static_cast<float>(1ull << 23) - 1.0f;
  }
};

float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// The experts' rows: uneven (+-40% around rows / E), expert 3 empty, each starting at the
// previous end rounded up to 128; R = the last end rounded up.
struct Rows {
  std::vector<int> ends;  // ends[g], g < E; the kernel's layout adds empty groups
  uint32_t R = 0, real = 0;
  uint32_t start(uint32_t g) const { return g == 0 ? 0 : (ends[g - 1] + kRowAlign - 1) / kRowAlign * kRowAlign; }
};

Rows make_rows(uint32_t experts, uint32_t rows, std::mt19937& rng) {
  std::uniform_real_distribution<double> share(0.6, 1.4);
  std::vector<double> w(experts);
  double total = 0;
  for (uint32_t g = 0; g < experts; ++g) total += w[g] = g == 3 ? 0.0 : share(rng);
  Rows r;
  uint32_t start = 0;
  for (uint32_t g = 0; g < experts; ++g) {
    const auto n = static_cast<uint32_t>(rows * w[g] / total);
    r.ends.push_back(static_cast<int>(start + n));
    r.real += n;
    start = (start + n + kRowAlign - 1) / kRowAlign * kRowAlign;
  }
  r.R = start;
  return r;
}

// The kernel's group ends: the experts' (as many as the compiled groups).
std::vector<int> kernel_ends(const Rows& rows) { return rows.ends; }

// The k-grouped kernel's group sizes: each expert's rows with its padding (zero rows).
std::vector<int> group_sizes(const Rows& rows) {
  std::vector<int> sizes;
  for (size_t g = 0; g < rows.ends.size(); ++g)
    sizes.push_back(static_cast<int>((g + 1 < rows.ends.size() ? rows.start(g + 1) : rows.R) - rows.start(g)));
  return sizes;
}

// Rows x cols of random bf16 with every expert's padding rows zero.
std::vector<__nv_bfloat16> row_operand(const Rows& rows, uint32_t cols, Random& random) {
  std::vector<__nv_bfloat16> v(size_t{rows.R} * cols, __float2bfloat16(0.0f));
  for (size_t g = 0; g < rows.ends.size(); ++g)
    for (size_t i = size_t{rows.start(g)} * cols; i < size_t(rows.ends[g]) * cols; ++i)
      v[i] = __float2bfloat16(random.next());
  return v;
}

std::vector<__nv_bfloat16> dense_operand(size_t n, Random& random) {
  std::vector<__nv_bfloat16> v(n);
  for (auto& x : v) x = __float2bfloat16(random.next());
  return v;
}

struct Check {
  double worst = 0, worst_share = 0;  // of the tolerance; of the terms' magnitude
  int checked = 0;
  void add(double got, double want, double magnitude) {
    const double allowed = std::ldexp(std::fabs(want), -7) + std::ldexp(magnitude, -14);
    worst = std::max(worst, std::fabs(got - want) / allowed);
    worst_share = std::max(worst_share, std::fabs(got - want) / std::max(magnitude, 1e-30));
    ++checked;
  }
};

void report(const char* what, const std::string& config, double flops, double ms, const Check& check,
            const char* note) {
  std::printf("%-34s %-44s %.3f ms, %4.0f TFLOP/s; %d sampled, worst %.1e of the terms' magnitude, %.2f of the "
              "tolerance: %s%s\n",
              what, config.c_str(), ms, flops / ms / 1e9, check.checked, check.worst_share, check.worst,
              check.worst <= 1 ? "ok" : "MISMATCH", note);
}

// Forward / data gradient: D [R, N] = A [R, K] @ B_g; B [E][N][K] (K-major) or [E][K][N].
struct RowGemm {
  const char* what;
  uint32_t N, K;
  bool b_mn_major;
};

template <typename C>
void run_rows(const RowGemm& gemm, const Rows& rows, const std::vector<__nv_bfloat16>& a,
              const std::vector<__nv_bfloat16>& b, std::mt19937& rng) {
  const uint32_t N = gemm.N, K = gemm.K, R = rows.R, E = static_cast<uint32_t>(rows.ends.size());
  if (C::kCluster > 1 && (N + C::kN - 1) / C::kN % 2 != 0) return;  // a cluster's pair needs an even N tile count
  auto* a_d = probe::device_copy(a);
  auto* b_d = probe::device_copy(b);
  int* ends_d = probe::device_copy(kernel_ends(rows));
  __nv_bfloat16* d_d = nullptr;
  CHECK_CUDA(cudaMalloc(&d_d, size_t{R} * N * 2));
  CHECK_CUDA(cudaMemset(d_d, 0xff, size_t{R} * N * 2));
  const auto bf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const auto swz = CU_TENSOR_MAP_SWIZZLE_128B;
  const CUtensorMap map_a = map_2d(bf16, a_d, K, R, uint64_t{K} * 2, kBlockK, C::kM, swz);
  const CUtensorMap map_b = gemm.b_mn_major ? map_2d(bf16, b_d, N, uint64_t{E} * K, uint64_t{N} * 2, 64, kBlockK, swz)
                                            : map_2d(bf16, b_d, K, uint64_t{E} * N, uint64_t{K} * 2, kBlockK, C::kN, swz);
  const CUtensorMap map_d = map_2d(bf16, d_d, N, R, uint64_t{N} * 2, 64, C::kM, swz);
  const size_t smem = C::smem_bytes();
  CHECK_CUDA(cudaFuncSetAttribute(C::kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  auto launch = [&] { probe::launch(C::kernel, C::kMathThreads, C::kCluster, smem, ends_d, R, N, K, map_a, map_b, map_d); };
  launch();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> out(size_t{R} * N);
  CHECK_CUDA(cudaMemcpy(out.data(), d_d, out.size() * 2, cudaMemcpyDeviceToHost));
  Check check;
  std::uniform_int_distribution<uint32_t> col(0, N - 1);
  for (uint32_t g = 0; g < E; ++g) {
    const uint32_t first = rows.start(g), end = static_cast<uint32_t>(rows.ends[g]);
    for (int s = 0; s < 12 && end > first; ++s) {
      const uint32_t m = first + (s * 7919u) % (end - first), n = col(rng);
      double want = 0, magnitude = 0;
      for (uint32_t k = 0; k < K; ++k) {
        const size_t bi = gemm.b_mn_major ? (size_t{g} * K + k) * N + n : (size_t{g} * N + n) * K + k;
        const double term = double(to_float(a[size_t{m} * K + k])) * to_float(b[bi]);
        want += term;
        magnitude += std::fabs(term);
      }
      check.add(to_float(out[size_t{m} * N + n]), want, magnitude);
    }
  }
  const double ms = probe::median_ms(launch);
  report(gemm.what, C::name(), 2.0 * rows.real * N * K, ms, check, "");
  CHECK_CUDA(cudaFree(a_d));
  CHECK_CUDA(cudaFree(b_d));
  CHECK_CUDA(cudaFree(ends_d));
  CHECK_CUDA(cudaFree(d_d));
}

// Weight gradient: D_g [M, N] = A_g^T [M, rows_g] @ B_g [rows_g, N], A [R, M], B [R, N].
struct WeightGemm {
  const char* what;
  uint32_t M, N;
};

template <typename C>
void run_weights(const WeightGemm& gemm, const Rows& rows, const std::vector<__nv_bfloat16>& a,
                 const std::vector<__nv_bfloat16>& b, std::mt19937& rng) {
  const uint32_t M = gemm.M, N = gemm.N, R = rows.R, E = static_cast<uint32_t>(rows.ends.size());
  auto* a_d = probe::device_copy(a);
  auto* b_d = probe::device_copy(b);
  int* sizes_d = probe::device_copy(group_sizes(rows));
  __nv_bfloat16* d_d = nullptr;
  const size_t d_size = size_t{E} * M * N;
  CHECK_CUDA(cudaMalloc(&d_d, d_size * 2));
  CHECK_CUDA(cudaMemset(d_d, 0xff, d_size * 2));
  const auto bf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const auto swz = CU_TENSOR_MAP_SWIZZLE_128B;
  const CUtensorMap map_a = map_2d(bf16, a_d, M, R, uint64_t{M} * 2, 64, kBlockK, swz);
  const CUtensorMap map_b = map_2d(bf16, b_d, N, R, uint64_t{N} * 2, 64, kBlockK, swz);
  const CUtensorMap map_d = map_2d(bf16, d_d, N, uint64_t{E} * M, uint64_t{N} * 2, 64, C::kM, swz);
  const size_t smem = C::smem_bytes();
  CHECK_CUDA(cudaFuncSetAttribute(C::kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // shape_k: the rows in all; each group's own K comes from the ends.
  auto launch = [&] { probe::launch(C::kernel, C::kMathThreads, C::kCluster, smem, sizes_d, M, N, R, map_a, map_b, map_d); };
  launch();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> out(d_size);
  CHECK_CUDA(cudaMemcpy(out.data(), d_d, out.size() * 2, cudaMemcpyDeviceToHost));
  Check check;
  bool empty_untouched = true;
  std::uniform_int_distribution<uint32_t> row(0, M - 1), col(0, N - 1);
  for (uint32_t g = 0; g < E; ++g) {
    const uint32_t first = rows.start(g), end = static_cast<uint32_t>(rows.ends[g]);
    for (int s = 0; s < 12; ++s) {
      const uint32_t m = row(rng), n = col(rng);
      const __nv_bfloat16 got = out[(size_t{g} * M + m) * N + n];
      if (end == first) {  // the kernel skips an empty group: D keeps its poison
        uint16_t bits;
        std::memcpy(&bits, &got, 2);
        empty_untouched = empty_untouched && bits == 0xffff;
        continue;
      }
      double want = 0, magnitude = 0;
      for (uint32_t k = first; k < end; ++k) {
        const double term = double(to_float(a[size_t{k} * M + m])) * to_float(b[size_t{k} * N + n]);
        want += term;
        magnitude += std::fabs(term);
      }
      check.add(to_float(got), want, magnitude);
    }
  }
  const double ms = probe::median_ms(launch);
  report(gemm.what, C::name(), 2.0 * rows.real * M * N, ms, check,
         empty_untouched ? "; the empty expert's D untouched" : "; the empty expert's D WRITTEN");
  CHECK_CUDA(cudaFree(a_d));
  CHECK_CUDA(cudaFree(b_d));
  CHECK_CUDA(cudaFree(sizes_d));
  CHECK_CUDA(cudaFree(d_d));
}

constexpr auto kM = GemmType::MGroupedContiguousWithPsumLayout;
constexpr auto kKG = GemmType::KGroupedContiguous;

// A model's six expert GEMMs a layer (D = dim, F = expert_hidden; gate|up as one [2F, D]
// weight, its data gradient one GEMM over K = 2F), in the tile shapes that fit 227 KB.
template <uint32_t G>
void probe_model(const char* model, uint32_t rows_total, uint32_t D, uint32_t F, std::mt19937& rng) {
  const uint32_t experts = G;
  std::printf("== %s: %u experts, %u rows, dim %u, expert_hidden %u\n", model, experts, rows_total, D, F);
  const Rows rows = make_rows(experts, rows_total, rng);
  Random random(rows_total + D + F);
  const auto x = row_operand(rows, D, random);        // x rows; dy rows have the same shape
  const auto h = row_operand(rows, 2 * F, random);    // d gate|up rows
  const auto act = row_operand(rows, F, random);      // act rows
  const auto w13 = dense_operand(size_t{experts} * 2 * F * D, random);  // [E][2F][D]
  const auto w2 = dense_operand(size_t{experts} * D * F, random);       // [E][D][F]
  for (const RowGemm& g : {RowGemm{"fwd gate|up [R,D]x[2F,D]^T", 2 * F, D, false}}) {
    run_rows<Config<G, Major::K, kM, 128, 128, 6, 1>>(g, rows, x, w13, rng);
    run_rows<Config<G, Major::K, kM, 128, 256, 3, 1>>(g, rows, x, w13, rng);
    run_rows<Config<G, Major::K, kM, 128, 256, 3, 2>>(g, rows, x, w13, rng);
  }
  for (const RowGemm& g : {RowGemm{"fwd down [R,F]x[D,F]^T", D, F, false}}) {
    run_rows<Config<G, Major::K, kM, 128, 128, 6, 1>>(g, rows, act, w2, rng);
    run_rows<Config<G, Major::K, kM, 128, 256, 3, 1>>(g, rows, act, w2, rng);
    run_rows<Config<G, Major::K, kM, 128, 256, 3, 2>>(g, rows, act, w2, rng);
  }
  for (const RowGemm& g : {RowGemm{"dgrad down [R,D]x[D,F]", F, D, true}}) {
    run_rows<Config<G, Major::MN, kM, 128, 128, 6, 1>>(g, rows, x, w2, rng);
    run_rows<Config<G, Major::MN, kM, 128, 256, 3, 1>>(g, rows, x, w2, rng);
    run_rows<Config<G, Major::MN, kM, 128, 256, 3, 2>>(g, rows, x, w2, rng);
  }
  for (const RowGemm& g : {RowGemm{"dgrad gate|up [R,2F]x[2F,D]", D, 2 * F, true}}) {
    run_rows<Config<G, Major::MN, kM, 128, 128, 6, 1>>(g, rows, h, w13, rng);
    run_rows<Config<G, Major::MN, kM, 128, 256, 3, 1>>(g, rows, h, w13, rng);
    run_rows<Config<G, Major::MN, kM, 128, 256, 3, 2>>(g, rows, h, w13, rng);
  }
  for (const auto& [g, a, b] : {std::tuple{WeightGemm{"wgrad gate|up [2F,R]x[R,D]", 2 * F, D}, &h, &x},
                                std::tuple{WeightGemm{"wgrad down [D,R]x[R,F]", D, F}, &x, &act}}) {
    run_weights<Config<G, Major::MN, kKG, 128, 128, 6, 1>>(g, rows, *a, *b, rng);
    run_weights<Config<G, Major::MN, kKG, 128, 256, 3, 1>>(g, rows, *a, *b, rng);
    run_weights<Config<G, Major::MN, kKG, 256, 128, 3, 1>>(g, rows, *a, *b, rng);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "both";
  probe::check_device_sms();
  std::mt19937 rng(11);
  // olmoe-mini: 32,768 tokens top-8 of 64 experts; mixtral-mini: 16,384 tokens top-2 of 8.
  if (which == "olmoe" || which == "both") probe_model<64>("olmoe-mini", 262144, 1024, 512, rng);
  if (which == "mixtral" || which == "both") probe_model<8>("mixtral-mini", 32768, 2048, 5632, rng);
  return 0;
}
