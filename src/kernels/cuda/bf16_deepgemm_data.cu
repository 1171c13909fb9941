// DeepGEMM's bf16 kernel for the experts' data gradients (bf16_deepgemm_kernels.h).
#include "kernels/cuda/bf16_deepgemm_instance.cuh"

namespace moe::cuda::bf16_deepgemm {

namespace {
template <uint32_t kMulticast, bool kAccumulate>
struct Data {
  template <uint32_t G>
  struct Pick {
    static constexpr Kernel value = kernel<G, kK, kMN, kPsum, kMulticast, kAccumulate>;
  };
};
}  // namespace

Kernel data_kernel(int64_t experts, bool pairs, bool accumulate) {
  if (accumulate) return pairs ? by_groups<Data<2, true>::Pick>(experts) : by_groups<Data<1, true>::Pick>(experts);
  return pairs ? by_groups<Data<2, false>::Pick>(experts) : by_groups<Data<1, false>::Pick>(experts);
}

}  // namespace moe::cuda::bf16_deepgemm
