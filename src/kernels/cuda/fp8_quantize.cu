// Blockwise e4m3 quantisation on the GPU: activation rows per 1 x 128 tile, weights per
// 128 x 128 block (and their transpose), the formats of kernels/fp8_blockwise.h, whose
// CPU functions these match bit for bit (tests/gpu/test_gpu_fp8_gemm.cpp).
#include <cuda_fp8.h>

#include "core/error_base.h"
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

namespace moe::cuda {
namespace {

using fp8::kBlock;

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// The first expert whose rows reach past row r (offsets ascending; empty experts skipped).
__device__ int64_t expert_of(const int32_t* offsets_E1, int64_t E, int64_t r) {
  int64_t lo = 0, hi = E;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets_E1[mid + 1] <= r) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// One warp per 1 x 128 tile (4 values a lane): the tile's amax, its scale, 128 codes.
constexpr int kRowThreads = 256, kTilesPerBlock = kRowThreads / 32;
__global__ void quantize_rows_kernel(uint8_t* codes_RK, float* scales, const __nv_bfloat16* x, int64_t ld_x,
                                     const int32_t* offsets_E1, int64_t E, int64_t R, int64_t K) {
  const int64_t KB = K / kBlock;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kTilesPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t r = tile / KB, kb = tile % KB;
  if (r >= R) return;
  int64_t first = 0, rows = R;
  if (offsets_E1 != nullptr) {
    if (r >= offsets_E1[E]) return;
    const int64_t e = expert_of(offsets_E1, E, r);
    first = offsets_E1[e];
    rows = offsets_E1[e + 1] - first;
  }
  const uint2 packed = *reinterpret_cast<const uint2*>(x + r * ld_x + kb * kBlock + lane * 4);
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&packed.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&packed.y);
  const float v[4] = {__low2float(lo), __high2float(lo), __low2float(hi), __high2float(hi)};
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = warp_max(amax);
  const float scale = fp8::block_scale(amax), inverse = 1.0f / scale;  // exact: a power of two
  if (lane == 0) scales[fp8::activation_scale_index(first, rows, r, kb, KB)] = scale;
  const uint32_t codes = static_cast<uint32_t>(to_e4m3(v[0] * inverse)) |
                         static_cast<uint32_t>(to_e4m3(v[1] * inverse)) << 8 |
                         static_cast<uint32_t>(to_e4m3(v[2] * inverse)) << 16 |
                         static_cast<uint32_t>(to_e4m3(v[3] * inverse)) << 24;
  *reinterpret_cast<uint32_t*>(codes_RK + r * K + kb * kBlock + lane * 4) = codes;
}

// One block per 128 x 128 weight block: its amax, then the codes, written as they are and
// (through shared memory) transposed.
constexpr int kWeightThreads = 256;
__global__ void quantize_weight_kernel(uint8_t* codes_ENK, float* scales, uint8_t* codes_t_EKN, float* scales_t,
                                       const __nv_bfloat16* w_ENK, int64_t N, int64_t K) {
  const int64_t kb = blockIdx.x, nb = blockIdx.y, e = blockIdx.z, NB = gridDim.y, KB = gridDim.x;
  const int64_t n0 = nb * kBlock, k0 = kb * kBlock;
  const __nv_bfloat16* w = w_ENK + e * N * K;
  float amax = 0.0f;
  for (int i = threadIdx.x; i < kBlock * kBlock; i += kWeightThreads) {
    const int64_t n = n0 + i / kBlock, k = k0 + i % kBlock;
    if (n < N && k < K) amax = fmaxf(amax, fabsf(to_float(w[n * K + k])));
  }
  __shared__ float warp_amax[kWeightThreads / 32];
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < kWeightThreads / 32; ++i) amax = fmaxf(amax, warp_amax[i]);
  const float scale = fp8::block_scale(amax), inverse = 1.0f / scale;
  if (threadIdx.x == 0) {
    if (scales != nullptr) scales[fp8::weight_scale_index(e, nb, kb, NB, KB)] = scale;
    if (scales_t != nullptr) scales_t[fp8::weight_t_scale_index(e, nb, kb, NB, KB)] = scale;
  }
  __shared__ uint8_t tile[kBlock][kBlock + 4];  // [n][k]
  for (int i = threadIdx.x; i < kBlock * kBlock; i += kWeightThreads) {
    const int dn = i / kBlock, dk = i % kBlock;
    const int64_t n = n0 + dn, k = k0 + dk;
    if (n < N && k < K) {
      const uint8_t code = to_e4m3(to_float(w[n * K + k]) * inverse);
      if (codes_ENK != nullptr) codes_ENK[(e * N + n) * K + k] = code;
      tile[dn][dk] = code;
    }
  }
  if (codes_t_EKN == nullptr) return;
  __syncthreads();
  for (int i = threadIdx.x; i < kBlock * kBlock; i += kWeightThreads) {
    const int dk = i / kBlock, dn = i % kBlock;
    const int64_t n = n0 + dn, k = k0 + dk;
    if (n < N && k < K) codes_t_EKN[(e * K + k) * N + n] = tile[dn][dk];
  }
}

}  // namespace

void quantize_rows_blockwise(uint8_t* codes_RK, float* scales, const bf16* x, int64_t ld_x,
                             const int32_t* offsets_E1, int64_t E, int64_t R, int64_t K, Stream stream) {
  MOE_CHECKF(K > 0 && K % kBlock == 0, "fp8 blockwise quantisation: K = %lld is not a multiple of %lld",
             static_cast<long long>(K), static_cast<long long>(kBlock));
  MOE_CHECKF(ld_x % 4 == 0 && ld_x >= K, "fp8 blockwise quantisation: row stride %lld (a multiple of 4, >= K)",
             static_cast<long long>(ld_x));
  MOE_CHECKF(offsets_E1 == nullptr || E >= 1, "fp8 blockwise quantisation: offsets of %lld experts",
             static_cast<long long>(E));
  const int64_t tiles = R * (K / kBlock);
  if (tiles == 0) return;
  const int64_t grid = (tiles + kTilesPerBlock - 1) / kTilesPerBlock;
  quantize_rows_kernel<<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(codes_RK, scales, as_cuda(x), ld_x,
                                                                                 offsets_E1, E, R, K);
  MOE_CUDA_CHECK_LAUNCH();
}

void quantize_weight_blocks(uint8_t* codes_ENK, float* scales, uint8_t* codes_t_EKN, float* scales_t,
                            const bf16* w_ENK, int64_t E, int64_t N, int64_t K, Stream stream) {
  MOE_CHECKF(E >= 0 && N > 0 && K > 0 && E <= 65535, "fp8 weight quantisation: bad shape [%lld, %lld, %lld]",
             static_cast<long long>(E), static_cast<long long>(N), static_cast<long long>(K));
  MOE_CHECKF((codes_ENK == nullptr) == (scales == nullptr) && (codes_t_EKN == nullptr) == (scales_t == nullptr) &&
                 (codes_ENK != nullptr || codes_t_EKN != nullptr),
             "fp8 weight quantisation: codes go with their scales, and at least one of the two copies");
  if (E == 0) return;
  const dim3 grid(static_cast<unsigned>(fp8::blocks(K)), static_cast<unsigned>(fp8::blocks(N)),
                  static_cast<unsigned>(E));
  quantize_weight_kernel<<<grid, kWeightThreads, 0, stream>>>(codes_ENK, scales, codes_t_EKN, scales_t, as_cuda(w_ENK),
                                                              N, K);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
