// One instantiation of DeepGEMM's bf16 kernel in bf16_deepgemm_kernels.h's tiles (included by
// the role files only: it pulls in DeepGEMM's headers).
#pragma once
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>

#include <type_traits>

#include "kernels/cuda/bf16_deepgemm_kernels.h"
#include "kernels/gpu_ops.h"

namespace moe::cuda::bf16_deepgemm {

template <uint32_t kGroups, cute::UMMA::Major kMajorA, cute::UMMA::Major kMajorB, deep_gemm::GemmType kType,
          uint32_t kMulticast, bool kAccumulate>
constexpr Kernel kernel =
    &deep_gemm::sm90_bf16_gemm_impl<kMajorA, kMajorB, 0, 0, 0, kGroups, kBlockM, kBlockN, kBlockK, 128, 128, 128,
                                    kStages, kTmaThreads, kMathThreads, kMulticast, false,
                                    static_cast<uint32_t>(kDeepGemmSms), kType, kAccumulate, cutlass::bfloat16_t>;

// Pick<G>::value (a kernel<G, ...>, or our own kernels') for the compiled group count that
// holds `experts`.
template <template <uint32_t> class Pick>
std::remove_cv_t<decltype(Pick<8>::value)> by_groups(int64_t experts) {
  switch (compiled_groups(experts)) {
    case 8: return Pick<8>::value;
    case 64: return Pick<64>::value;
    default: return Pick<256>::value;
  }
}

// The same for kernels compiled with and without 2-CTA clusters (`pairs`):
// ByCluster<kMulticast>::Pick<G>::value.
template <template <uint32_t> class ByCluster>
auto by_groups_and_cluster(int64_t experts, bool pairs) {
  return pairs ? by_groups<ByCluster<2>::template Pick>(experts) : by_groups<ByCluster<1>::template Pick>(experts);
}

constexpr auto kK = cute::UMMA::Major::K, kMN = cute::UMMA::Major::MN;
constexpr auto kPsum = deep_gemm::GemmType::MGroupedContiguousWithPsumLayout;
constexpr auto kKGrouped = deep_gemm::GemmType::KGroupedContiguous;

}  // namespace moe::cuda::bf16_deepgemm
