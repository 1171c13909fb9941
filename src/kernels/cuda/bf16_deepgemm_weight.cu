// DeepGEMM's bf16 kernel for the experts' weight gradients (bf16_deepgemm_kernels.h).
#include "kernels/cuda/bf16_deepgemm_instance.cuh"

namespace moe::cuda::bf16_deepgemm {

namespace {
template <uint32_t kMulticast>
struct Weight {
  template <uint32_t G>
  struct Pick {
    static constexpr Kernel value = kernel<G, kMN, kMN, kKGrouped, kMulticast, false>;
  };
};
}  // namespace

Kernel weight_kernel(int64_t experts, bool pairs) { return by_groups_and_cluster<Weight>(experts, pairs); }

}  // namespace moe::cuda::bf16_deepgemm
