// Expert weight-gradient GEMMs into bf16 gradients (training.expert_grad_dtype = bf16;
// grouped_gemm_weight.cuh): fp32 accumulation, the sum with the old gradient in fp32,
// one rounding to bf16 (nearest even) on the way out.
#include "kernels/cuda/grouped_gemm_weight.cuh"

namespace moe::cuda::grouped {

Sizes weight_bf16_sizes(int max_groups, int sm_count) {
  return WeightGemm<ElementAB>::sizes(max_groups, sm_count);
}

void backward_weight_bf16(const Scratch& scratch, int sets, bf16* const* dw, const bf16* const* a, int64_t ld_a,
                          const bf16* b, int64_t ld_b, const int32_t* offsets_E1, int64_t E, int64_t M, int64_t N,
                          float beta, Stream stream) {
  WeightGemm<ElementAB>::run(scratch, sets, dw, a, ld_a, b, ld_b, offsets_E1, E, M, N, beta, stream);
}

}  // namespace moe::cuda::grouped
