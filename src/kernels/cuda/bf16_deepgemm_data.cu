// DeepGEMM's bf16 kernel for the experts' data gradients (bf16_deepgemm_kernels.h).
#include "kernels/cuda/bf16_deepgemm_instance.cuh"

namespace moe::cuda::bf16_deepgemm {

namespace {
template <bool kAccumulate>
struct Data {
  template <uint32_t kMulticast>
  struct ByCluster {
    template <uint32_t G>
    struct Pick {
      static constexpr Kernel value = kernel<G, kK, kMN, kPsum, kMulticast, kAccumulate>;
    };
  };
};
}  // namespace

Kernel data_kernel(int64_t experts, bool pairs, bool accumulate) {
  return accumulate ? by_groups_and_cluster<Data<true>::ByCluster>(experts, pairs)
                    : by_groups_and_cluster<Data<false>::ByCluster>(experts, pairs);
}

}  // namespace moe::cuda::bf16_deepgemm
