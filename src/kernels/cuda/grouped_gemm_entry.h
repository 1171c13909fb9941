// Entry points of the grouped-GEMM instantiations (grouped_gemm_{forward,data,
// weight,weight_bf16}.cu), behind ExpertGemm (grouped_gemm.cu). Kept free of CUTLASS headers.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/gpu_ops.h"

namespace moe::cuda::grouped {

// Device memory one operation may use: its per-group arrays and the CUTLASS workspace.
struct Scratch {
  void* groups = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int sm_count = 0;
};

// SMs per thread-block cluster (the kernels' ClusterShape): a persistent launch must use
// a multiple of it, or CUTLASS fails with an internal error.
constexpr int kClusterSms = 2;

struct Sizes {
  size_t group_bytes, workspace_bytes;
};

Sizes forward_sizes(int max_groups, int sm_count);
Sizes data_sizes(int max_groups, int sm_count);
Sizes weight_sizes(int max_groups, int sm_count);
Sizes weight_bf16_sizes(int max_groups, int sm_count);

void forward(const Scratch& scratch, int sets, bf16* const* out, int64_t ld_out, const bf16* x, int64_t ld_x,
             const bf16* const* w, const int32_t* offsets_E1, int64_t E, int64_t N, int64_t K, Stream stream);
void backward_data(const Scratch& scratch, bf16* out, int64_t ld_out, const bf16* dy, int64_t ld_dy, const bf16* w,
                   const int32_t* offsets_E1, int64_t E, int64_t N, int64_t K, float beta, Stream stream);
void backward_weight(const Scratch& scratch, int sets, float* const* dw, const bf16* const* a, int64_t ld_a,
                     const bf16* b, int64_t ld_b, const int32_t* offsets_E1, int64_t E, int64_t M, int64_t N,
                     float beta, Stream stream);
void backward_weight_bf16(const Scratch& scratch, int sets, bf16* const* dw, const bf16* const* a, int64_t ld_a,
                          const bf16* b, int64_t ld_b, const int32_t* offsets_E1, int64_t E, int64_t M, int64_t N,
                          float beta, Stream stream);

}  // namespace moe::cuda::grouped
