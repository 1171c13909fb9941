// Expert weight-gradient GEMMs: dW_e (fp32, [M, N]) += a rows of e ^T @ b rows of e. The
// reduction runs over the expert's rows, so an expert without rows is skipped (its
// gradient is unchanged) rather than given K = 0, which the kernel does not support.
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/grouped_gemm_entry.h"

namespace moe::cuda::grouped {
namespace {

using Weight = GroupedGemmKernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float>;

struct Sets {
  const ElementAB* a[ExpertGemm::kMaxSets];
  float* dw[ExpertGemm::kMaxSets];
};

__global__ void describe_weight(Weight::Groups g, Sets sets, int groups, const int32_t* offsets_E1, int64_t E,
                                int64_t M, int64_t N, int64_t ld_a, const ElementAB* b, int64_t ld_b) {
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
  g.stride_a[group] = leading_stride<Weight::StrideA>(ld_a);
  g.stride_b[group] = leading_stride<Weight::StrideB>(ld_b);
  g.stride_c[group] = leading_stride<Weight::StrideC>(N);
  g.stride_d[group] = leading_stride<Weight::StrideD>(N);
}

}  // namespace

Sizes weight_sizes(int max_groups, int sm_count) {
  return {Weight::group_bytes(max_groups), Weight::workspace_bytes(max_groups, sm_count)};
}

void backward_weight(const Scratch& scratch, int sets, float* const* dw, const bf16* const* a, int64_t ld_a,
                     const bf16* b, int64_t ld_b, const int32_t* offsets_E1, int64_t E, int64_t M, int64_t N,
                     Stream stream) {
  const int groups = static_cast<int>(sets * E);
  Sets pointers{};
  for (int s = 0; s < sets; ++s) {
    pointers.a[s] = reinterpret_cast<const ElementAB*>(a[s]);
    pointers.dw[s] = dw[s];
  }
  const Weight::Groups g = Weight::carve(scratch.groups, groups);
  describe_weight<<<(groups + 127) / 128, 128, 0, stream>>>(g, pointers, groups, offsets_E1, E, M, N, ld_a,
                                                             reinterpret_cast<const ElementAB*>(b), ld_b);
  MOE_CUDA_CHECK(cudaGetLastError());
  // Accumulate into the fp32 gradient: beta = 1.
  Weight::run(g, groups, 1.0f, 1.0f, scratch.workspace, scratch.workspace_bytes, scratch.sm_count, stream);
}

}  // namespace moe::cuda::grouped
