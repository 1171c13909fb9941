// Expert weight-gradient GEMMs: dW_e ([M, N], fp32 or bf16) += a rows of e ^T @ b rows of
// e, accumulated in fp32 inside the GEMM (beta = 1 reads the gradient, bf16 ones widened).
// The reduction runs over the expert's rows, so an expert without rows is skipped (its
// gradient is unchanged) rather than given K = 0, which the kernel does not support.
// One template for both gradient types; each is instantiated in its own translation unit
// (grouped_gemm_weight.cu, grouped_gemm_weight_bf16.cu: they compile slowly).
#pragma once
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/grouped_gemm_entry.h"

namespace moe::cuda::grouped {

template <class ElementD>
struct WeightGemm {
  using Weight = GroupedGemmKernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, ElementD>;

  struct Sets {
    const ElementAB* a[ExpertGemm::kMaxSets];
    ElementD* dw[ExpertGemm::kMaxSets];
  };

  static Sizes sizes(int max_groups, int sm_count) {
    return {Weight::group_bytes(max_groups), Weight::workspace_bytes(max_groups, sm_count)};
  }

  template <class Out>
  static void run(const Scratch& scratch, int sets, Out* const* dw, const bf16* const* a, int64_t ld_a, const bf16* b,
                  int64_t ld_b, const int32_t* offsets_E1, int64_t E, int64_t M, int64_t N, Stream stream);
};

template <class ElementD>
__global__ void describe_weight(typename WeightGemm<ElementD>::Weight::Groups g, typename WeightGemm<ElementD>::Sets sets,
                                int groups, const int32_t* offsets_E1, int64_t E, int64_t M, int64_t N, int64_t ld_a,
                                const ElementAB* b, int64_t ld_b) {
  using Weight = typename WeightGemm<ElementD>::Weight;
  const int group = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (group >= groups) return;
  const GroupIndex at = group_index(group, E);
  const int64_t first = offsets_E1[at.expert], rows = offsets_E1[at.expert + 1] - first;
  g.shapes[group] = rows > 0 ? GroupShape(static_cast<int>(M), static_cast<int>(N), static_cast<int>(rows))
                             : GroupShape(0, static_cast<int>(N), 0);
  g.a[group] = sets.a[at.set] + first * ld_a;
  g.b[group] = b + first * ld_b;
  g.c[group] = sets.dw[at.set] + at.expert * M * N;
  g.d[group] = sets.dw[at.set] + at.expert * M * N;
  g.stride_a[group] = leading_stride<typename Weight::StrideA>(ld_a);
  g.stride_b[group] = leading_stride<typename Weight::StrideB>(ld_b);
  g.stride_c[group] = leading_stride<typename Weight::StrideC>(N);
  g.stride_d[group] = leading_stride<typename Weight::StrideD>(N);
}

template <class ElementD>
template <class Out>
void WeightGemm<ElementD>::run(const Scratch& scratch, int sets, Out* const* dw, const bf16* const* a, int64_t ld_a,
                               const bf16* b, int64_t ld_b, const int32_t* offsets_E1, int64_t E, int64_t M, int64_t N,
                               Stream stream) {
  static_assert(sizeof(Out) == sizeof(ElementD), "the gradient type is the GEMM's output type");
  const int groups = static_cast<int>(sets * E);
  Sets pointers{};
  for (int s = 0; s < sets; ++s) {
    pointers.a[s] = reinterpret_cast<const ElementAB*>(a[s]);
    pointers.dw[s] = reinterpret_cast<ElementD*>(dw[s]);
  }
  const typename Weight::Groups g = Weight::carve(scratch.groups, groups);
  describe_weight<ElementD><<<(groups + 127) / 128, 128, 0, stream>>>(
      g, pointers, groups, offsets_E1, E, M, N, ld_a, reinterpret_cast<const ElementAB*>(b), ld_b);
  MOE_CUDA_CHECK(cudaGetLastError());
  // Accumulate into the gradient: beta = 1.
  Weight::run(g, groups, 1.0f, 1.0f, scratch.workspace, scratch.workspace_bytes, scratch.sm_count, stream);
}

}  // namespace moe::cuda::grouped
