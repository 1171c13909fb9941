// DeepGEMM's Hopper fp8 GEMM (sm90_fp8_gemm_1d2d_impl, headers of the PyPI wheel
// sgl-deep-gemm; training.fp8_gemm_backend = deepgemm): A e4m3 with 1 x 128 scales, one
// MN-major [K / 128][M] array read through TMA; B e4m3 [.., N, K] with 128 x 128 scales,
// MN-major per B (our weight blocks' layout); bf16 D, no accumulation.
//  - PaddedExpertGemmFp8: the m-grouped "psum" layout, group g's rows from the 128-aligned
//    end of group g - 1 to grouped_layout[g], read on the device; compiled for group counts
//    8 to 256 (the smallest that holds the experts): the groups past them are empty.
//  - dense_gemm_deepgemm: one GEMM (GemmType::Normal), the dense projections'.
// The kernel is persistent over a compiled SM count: the grid is exactly kSms CTAs.
// docs/KERNEL_ROADMAP.md, "FP8: a grouped GEMM of DeepGEMM's class".
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>

#include "core/error_base.h"
#include "core/gpu.h"
#include "kernels/cuda/deepgemm_host.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr uint32_t kBlockM = 128, kBlockN = 128, kBlockK = 128, kStages = 5;
constexpr uint32_t kTmaThreads = 128, kMathThreads = 256;
constexpr uint32_t kSms = kDeepGemmSms;
constexpr uint32_t kGroups = PaddedExpertGemmFp8::kMaxExperts;
static_assert(kBlockM == fp8::kBlock && kBlockK == fp8::kBlock, "one tile of rows and of K per scale block");

using Descriptor = cute::TmaDescriptor;
using Kernel = void (*)(float*, int*, uint32_t, uint32_t, uint32_t, const Descriptor, const Descriptor,
                        const Descriptor, const Descriptor);

// BLOCK 128 x 128 x 128, 5 stages, 128 TMA + 256 math threads; B's scales MN-major; bf16 D.
// kMulticast 2: a cluster of two CTAs on consecutive row tiles shares B's tile (one TMA
// load for both). Both CTAs must always have a tile and the same B: in the grouped layout
// every expert's tile count even (an even count of N tiles), in a dense GEMM an even count
// of row tiles; else kMulticast 1.
template <uint32_t kGroupCount, deep_gemm::GemmType kType, uint32_t kMulticast>
constexpr Kernel kernel =
    &deep_gemm::sm90_fp8_gemm_1d2d_impl<cute::UMMA::Major::MN, 0, 0, 0, kGroupCount, kBlockM, kBlockN, kBlockK, 128,
                                        128, 128, kStages, kTmaThreads, kMathThreads, kMulticast, false, kSms, kType,
                                        cutlass::bfloat16_t, fp8::kBlock>;
constexpr auto kGrouped = deep_gemm::GemmType::MGroupedContiguousWithPsumLayout;
constexpr auto kDense = deep_gemm::GemmType::Normal;
constexpr const char* kWhat = "DeepGEMM fp8 GEMM";

// The grouped kernel for `experts` groups: compiled for 8, 16, ..., 256. Each CTA's
// scheduler walks every compiled group before it exits, empty ones too (a dependent load of
// the group's end each, ~50 cycles: 248 empty groups were ~7 us a launch), so the smallest
// count that holds the experts.
template <uint32_t kMulticast>
Kernel grouped_kernel(int64_t experts) {
  if (experts <= 8) return kernel<8, kGrouped, kMulticast>;
  if (experts <= 16) return kernel<16, kGrouped, kMulticast>;
  if (experts <= 32) return kernel<32, kGrouped, kMulticast>;
  if (experts <= 64) return kernel<64, kGrouped, kMulticast>;
  if (experts <= 128) return kernel<128, kGrouped, kMulticast>;
  return kernel<kGroups, kGrouped, kMulticast>;
}

// The kernel's shared memory: D's tile, the stages' A and B tiles and A scales, B's scales
// over all of K, the stages' two barriers.
size_t shared_bytes(int64_t K) {
  const size_t d = (size_t{kBlockM} * kBlockN * 2 + 1023) / 1024 * 1024;
  const size_t stages = size_t{kStages} * ((kBlockM + kBlockN) * kBlockK + (kBlockM * 4 + 127) / 128 * 128);
  const size_t sfb = (static_cast<size_t>(K / kBlockK) * 4 + 7) / 8 * 8;
  return d + stages + sfb + 2 * kStages * 8;
}

// D [M, N] (row pitch ld_out) = A [M, K] @ B_g^T through `k` on `multicast` CTAs a
// cluster; `groups` B matrices of [N, K] in b (the grouped layout's ends in grouped_layout).
void launch(Kernel k, uint32_t multicast, int groups, int32_t* grouped_layout, bf16* out, int64_t ld_out,
            const uint8_t* a, const float* sfa, const uint8_t* b, const float* sfb, int64_t M, int64_t N, int64_t K,
            Stream stream) {
  for (const void* p : {static_cast<const void*>(out), static_cast<const void*>(a), static_cast<const void*>(sfa),
                        static_cast<const void*>(b)})
    MOE_CHECKF(reinterpret_cast<uintptr_t>(p) % 16 == 0,
               "DeepGEMM fp8 GEMM: operands and output must be 16-byte aligned (TMA)");
  const Descriptor map_a = deepgemm::map_2d(CU_TENSOR_MAP_DATA_TYPE_UINT8, a, K, M, K, kBlockK, kBlockM,
                                  CU_TENSOR_MAP_SWIZZLE_128B, kWhat);
  const Descriptor map_b = deepgemm::map_2d(CU_TENSOR_MAP_DATA_TYPE_UINT8, b, K, groups * N, K, kBlockK, kBlockN,
                                  CU_TENSOR_MAP_SWIZZLE_128B, kWhat);
  // D in boxes as wide as the 128-byte swizzle (64 bf16), as the kernel's epilogue stores.
  const Descriptor map_d = deepgemm::map_2d(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, out, N, M, ld_out * 2, 64, kBlockM,
                                  CU_TENSOR_MAP_SWIZZLE_128B, kWhat);
  const Descriptor map_sfa = deepgemm::map_2d(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, sfa, M, K / kBlockK, M * 4, kBlockM, 1,
                                    CU_TENSOR_MAP_SWIZZLE_NONE, kWhat);
  // Per call (a cheap driver call): the attribute is the current device's (thread ranks drive several).
  const size_t shared = shared_bytes(K);
  MOE_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = multicast;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(kSms);
  config.blockDim = dim3(kTmaThreads + kMathThreads);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, k, const_cast<float*>(sfb), grouped_layout, static_cast<uint32_t>(M),
                                    static_cast<uint32_t>(N), static_cast<uint32_t>(K), map_a, map_b, map_d,
                                    map_sfa));
}

void check_shape(const char* what, int64_t M, int64_t N, int64_t K, int64_t ld_out) {
  MOE_CHECKF(K > 0 && K % fp8::kBlock == 0, "%s: K = %lld is not a multiple of %lld (the fp8 scale blocks)", what,
             static_cast<long long>(K), static_cast<long long>(fp8::kBlock));
  MOE_CHECKF(N > 0 && N % 8 == 0 && ld_out % 8 == 0 && ld_out >= N,
             "%s: N = %lld and ld_out = %lld must be multiples of 8 (ld_out >= N)", what, static_cast<long long>(N),
             static_cast<long long>(ld_out));
  MOE_CHECKF(M > 0 && M % 4 == 0 && M <= INT32_MAX,
             "%s: R = %lld rows must be a positive multiple of 4 (the scales' TMA row pitch)", what,
             static_cast<long long>(M));
}

}  // namespace

struct PaddedExpertGemmFp8::State {
  int64_t max_experts = 0, n_experts = 0;
  // One array of group ends per operation, so that operations on different streams never
  // overwrite each other's.
  gpu::DeviceArray<int32_t> forward_ends, data_ends;

  // The kernel's group ends from the experts' offsets, once per call (every set reads them).
  void write_ends(int32_t* ends, const int32_t* offsets_E1, Stream stream) const {
    deepgemm::write_group_ends(ends, kGroups, offsets_E1, n_experts, kBlockM, stream);
  }
  void run(int32_t* ends, bf16* out, int64_t ld_out, const uint8_t* a, const float* sfa, const uint8_t* b,
           const float* sfb, int64_t R, int64_t N, int64_t K, Stream stream) const {
    const int64_t E = n_experts;
    const bool pairs = fp8::blocks(N) % 2 == 0;
    launch(pairs ? grouped_kernel<2>(E) : grouped_kernel<1>(E), pairs ? 2 : 1, static_cast<int>(E), ends, out,
           ld_out, a, sfa, b, sfb, R, N, K, stream);
  }
};

PaddedExpertGemmFp8::PaddedExpertGemmFp8(int64_t max_experts) : state_(new State) {
  State& s = *state_;
  MOE_CHECKF(max_experts >= 1 && max_experts <= kMaxExperts, "PaddedExpertGemmFp8: %lld experts (1 to %lld)",
             static_cast<long long>(max_experts), static_cast<long long>(kMaxExperts));
  MOE_CHECKF(deepgemm_available(), "PaddedExpertGemmFp8: needs an sm_90 GPU with %lld multiprocessors",
             static_cast<long long>(kSms));
  s.max_experts = s.n_experts = max_experts;
  s.forward_ends = gpu::DeviceArray<int32_t>(kGroups);
  s.data_ends = gpu::DeviceArray<int32_t>(kGroups);
}

PaddedExpertGemmFp8::~PaddedExpertGemmFp8() { delete state_; }

void PaddedExpertGemmFp8::set_experts(int64_t n_experts) {
  MOE_CHECKF(n_experts >= 0 && n_experts <= state_->max_experts, "PaddedExpertGemmFp8: %lld experts, room for %lld",
             static_cast<long long>(n_experts), static_cast<long long>(state_->max_experts));
  state_->n_experts = n_experts;
}


void PaddedExpertGemmFp8::forward(int sets, bf16* const* out, int64_t ld_out, const uint8_t* x_codes,
                                  const float* x_scales, const uint8_t* const* w_codes, const float* const* w_scales,
                                  const int32_t* offsets_E1, int64_t R, int64_t N, int64_t K, Stream stream) {
  MOE_CHECKF(sets >= 1 && sets <= kMaxSets, "PaddedExpertGemmFp8: %d sets", sets);
  check_shape("PaddedExpertGemmFp8::forward", R, N, K, ld_out);
  if (state_->n_experts == 0) return;
  state_->write_ends(state_->forward_ends.data(), offsets_E1, stream);
  for (int s = 0; s < sets; ++s)
    state_->run(state_->forward_ends.data(), out[s], ld_out, x_codes, x_scales, w_codes[s], w_scales[s], R, N, K,
                stream);
}

void PaddedExpertGemmFp8::backward_data(bf16* out, int64_t ld_out, const uint8_t* dy_codes, const float* dy_scales,
                                        const uint8_t* wt_codes, const float* wt_scales, const int32_t* offsets_E1,
                                        int64_t R, int64_t N, int64_t K, Stream stream) {
  check_shape("PaddedExpertGemmFp8::backward_data", R, N, K, ld_out);
  if (state_->n_experts == 0) return;
  state_->write_ends(state_->data_ends.data(), offsets_E1, stream);
  state_->run(state_->data_ends.data(), out, ld_out, dy_codes, dy_scales, wt_codes, wt_scales, R, N, K, stream);
}

void dense_gemm_deepgemm(bf16* c, int64_t ldc, const uint8_t* a_codes, const float* a_scales, const uint8_t* b_codes,
                         const float* b_scales, int64_t M, int64_t N, int64_t K, Stream stream) {
  check_shape("DeepGEMM dense fp8 GEMM", M, N, K, ldc);
  MOE_CHECKF(deepgemm_available(), "DeepGEMM dense fp8 GEMM: needs an sm_90 GPU with %lld multiprocessors",
             static_cast<long long>(kSms));
  const bool pairs = fp8::blocks(M) % 2 == 0;
  launch(pairs ? kernel<1, kDense, 2> : kernel<1, kDense, 1>, pairs ? 2 : 1, 1, nullptr, c, ldc, a_codes, a_scales,
         b_codes, b_scales, M, N, K, stream);
}

}  // namespace moe::cuda
