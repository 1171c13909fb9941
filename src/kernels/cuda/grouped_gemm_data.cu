// Expert data-gradient GEMMs: out rows of e = dy rows of e @ W_e (W_e stored [K, N]).
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/grouped_gemm_entry.h"

namespace moe::cuda::grouped {
namespace {

using Data = GroupedGemmKernel<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t>;

__global__ void describe_data(Data::Groups g, int groups, const int32_t* offsets_E1, int64_t N, int64_t K,
                              const ElementAB* dy, int64_t ld_dy, const ElementAB* w, cutlass::bfloat16_t* out,
                              int64_t ld_out) {
  const int expert = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (expert >= groups) return;
  const int64_t first = offsets_E1[expert], rows = offsets_E1[expert + 1] - first;
  g.shapes[expert] = GroupShape(static_cast<int>(rows), static_cast<int>(N), static_cast<int>(K));
  g.a[expert] = dy + first * ld_dy;
  g.b[expert] = w + expert * K * N;
  g.c[expert] = out + first * ld_out;
  g.d[expert] = out + first * ld_out;
  g.stride_a[expert] = leading_stride<Data::StrideA>(ld_dy);
  g.stride_b[expert] = leading_stride<Data::StrideB>(N);
  g.stride_c[expert] = leading_stride<Data::StrideC>(ld_out);
  g.stride_d[expert] = leading_stride<Data::StrideD>(ld_out);
}

}  // namespace

Sizes data_sizes(int max_groups, int sm_count) {
  return {Data::group_bytes(max_groups), Data::workspace_bytes(max_groups, sm_count)};
}

void backward_data(const Scratch& scratch, bf16* out, int64_t ld_out, const bf16* dy, int64_t ld_dy, const bf16* w,
                   const int32_t* offsets_E1, int64_t E, int64_t N, int64_t K, float beta, Stream stream) {
  const int groups = static_cast<int>(E);
  const Data::Groups g = Data::carve(scratch.groups, groups);
  describe_data<<<(groups + 127) / 128, 128, 0, stream>>>(
      g, groups, offsets_E1, N, K, reinterpret_cast<const ElementAB*>(dy), ld_dy,
      reinterpret_cast<const ElementAB*>(w), reinterpret_cast<cutlass::bfloat16_t*>(out), ld_out);
  MOE_CUDA_CHECK(cudaGetLastError());
  Data::run(g, groups, 1.0f, beta, scratch.workspace, scratch.workspace_bytes, scratch.sm_count, stream);
}

}  // namespace moe::cuda::grouped
