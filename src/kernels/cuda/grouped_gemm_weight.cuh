// Expert weight-gradient GEMMs: dW_e ([M, N], fp32 or bf16) = beta * dW_e + a rows of e ^T
// @ b rows of e, accumulated in fp32 inside the GEMM (beta = 1 reads the gradient, bf16
// ones widened; beta = 0 never reads it: the step's first micro-batch writes its gradients
// without a zeroing pass). The reduction runs over the expert's rows, so an expert without
// rows is skipped rather than given K = 0, which the kernel does not support: its gradient
// is unchanged (beta = 1) or zeroed by a small kernel reading the same device offsets
// (beta = 0), so no host synchronisation either way.
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
                  int64_t ld_b, const int32_t* offsets_E1, int64_t E, int64_t M, int64_t N, float beta, Stream stream);
};

// beta = 0: the experts without rows get zero gradients. blockIdx.x: the group; the y
// blocks share its slice. 16-byte stores where the slice allows them.
template <class ElementD>
__global__ void zero_empty_experts(typename WeightGemm<ElementD>::Sets sets, const int32_t* offsets_E1, int64_t E,
                                   int64_t slice) {
  const GroupIndex at = group_index(static_cast<int>(blockIdx.x), E);
  if (offsets_E1[at.expert + 1] != offsets_E1[at.expert]) return;
  char* base = reinterpret_cast<char*>(sets.dw[at.set] + at.expert * slice);
  const int64_t bytes = slice * static_cast<int64_t>(sizeof(ElementD));
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if ((reinterpret_cast<uintptr_t>(base) & 15) == 0 && bytes % 16 == 0) {
    uint4* out = reinterpret_cast<uint4*>(base);
    for (int64_t i = first; i < bytes / 16; i += stride) out[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = first; i < bytes; i += stride) base[i] = 0;
  }
}

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
                               float beta, Stream stream) {
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
  if (beta == 0.0f) {
    zero_empty_experts<ElementD><<<dim3(static_cast<unsigned>(groups), 16), 256, 0, stream>>>(pointers, offsets_E1, E,
                                                                                               M * N);
    MOE_CUDA_CHECK(cudaGetLastError());
  }
  Weight::run(g, groups, 1.0f, beta, scratch.workspace, scratch.workspace_bytes, scratch.sm_count, stream);
}

}  // namespace moe::cuda::grouped
