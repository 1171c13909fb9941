// Expert forward GEMMs: out rows of e = x rows of e @ W_e^T (W_e a [N, K] Linear weight).
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/grouped_gemm_entry.h"

namespace moe::cuda::grouped {
namespace {

using Forward = GroupedGemmKernel<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t>;

struct Sets {
  const ElementAB* w[ExpertGemm::kMaxSets];
  cutlass::bfloat16_t* out[ExpertGemm::kMaxSets];
};

__global__ void describe_forward(Forward::Groups g, Sets sets, int groups, const int32_t* offsets_E1, int64_t E,
                                 int64_t N, int64_t K, const ElementAB* x, int64_t ld_x, int64_t ld_out) {
  const int group = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (group >= groups) return;
  const GroupIndex at = group_index(group, E);
  const int64_t first = offsets_E1[at.expert], rows = offsets_E1[at.expert + 1] - first;
  g.shapes[group] = GroupShape(static_cast<int>(rows), static_cast<int>(N), static_cast<int>(K));
  g.a[group] = x + first * ld_x;
  g.b[group] = sets.w[at.set] + at.expert * N * K;
  g.c[group] = sets.out[at.set] + first * ld_out;
  g.d[group] = sets.out[at.set] + first * ld_out;
  g.stride_a[group] = leading_stride<Forward::StrideA>(ld_x);
  g.stride_b[group] = leading_stride<Forward::StrideB>(K);
  g.stride_c[group] = leading_stride<Forward::StrideC>(ld_out);
  g.stride_d[group] = leading_stride<Forward::StrideD>(ld_out);
}

}  // namespace

Sizes forward_sizes(int max_groups, int sm_count) {
  return {Forward::group_bytes(max_groups), Forward::workspace_bytes(max_groups, sm_count)};
}

void forward(const Scratch& scratch, int sets, bf16* const* out, int64_t ld_out, const bf16* x, int64_t ld_x,
             const bf16* const* w, const int32_t* offsets_E1, int64_t E, int64_t N, int64_t K, Stream stream) {
  const int groups = static_cast<int>(sets * E);
  Sets pointers{};
  for (int s = 0; s < sets; ++s) {
    pointers.w[s] = reinterpret_cast<const ElementAB*>(w[s]);
    pointers.out[s] = reinterpret_cast<cutlass::bfloat16_t*>(out[s]);
  }
  const Forward::Groups g = Forward::carve(scratch.groups, groups);
  describe_forward<<<(groups + 127) / 128, 128, 0, stream>>>(g, pointers, groups, offsets_E1, E, N, K,
                                                              reinterpret_cast<const ElementAB*>(x), ld_x, ld_out);
  MOE_CUDA_CHECK(cudaGetLastError());
  Forward::run(g, groups, 1.0f, 0.0f, scratch.workspace, scratch.workspace_bytes, scratch.sm_count, stream);
}

}  // namespace moe::cuda::grouped
