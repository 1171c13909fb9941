// DeepGEMM's bf16 kernel for the experts' weight gradients (bf16_deepgemm_kernels.h).
#include "kernels/cuda/bf16_deepgemm_instance.cuh"

namespace moe::cuda::bf16_deepgemm {

namespace {
template <uint32_t G>
struct Weight {
  static constexpr Kernel value = kernel<G, kMN, kMN, kKGrouped, 1, false>;
};
}  // namespace

Kernel weight_kernel(int64_t experts) { return by_groups<Weight>(experts); }

}  // namespace moe::cuda::bf16_deepgemm
