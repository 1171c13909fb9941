// DeepGEMM's bf16 kernel for the experts' forward (bf16_deepgemm_kernels.h).
#include "kernels/cuda/bf16_deepgemm_instance.cuh"

namespace moe::cuda::bf16_deepgemm {

namespace {
template <uint32_t kMulticast>
struct Forward {
  template <uint32_t G>
  struct Pick {
    static constexpr Kernel value = kernel<G, kK, kK, kPsum, kMulticast, false>;
  };
};
}  // namespace

Kernel forward_kernel(int64_t experts, bool pairs) { return by_groups_and_cluster<Forward>(experts, pairs); }

}  // namespace moe::cuda::bf16_deepgemm
