// Expert weight-gradient GEMMs into fp32 gradients (grouped_gemm_weight.cuh).
#include "kernels/cuda/grouped_gemm_weight.cuh"

namespace moe::cuda::grouped {

Sizes weight_sizes(int max_groups, int sm_count) { return WeightGemm<float>::sizes(max_groups, sm_count); }

void backward_weight(const Scratch& scratch, int sets, float* const* dw, const bf16* const* a, int64_t ld_a,
                     const bf16* b, int64_t ld_b, const int32_t* offsets_E1, int64_t E, int64_t M, int64_t N,
                     float beta, Stream stream) {
  WeightGemm<float>::run(scratch, sets, dw, a, ld_a, b, ld_b, offsets_E1, E, M, N, beta, stream);
}

}  // namespace moe::cuda::grouped
