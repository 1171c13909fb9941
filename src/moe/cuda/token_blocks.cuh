// The expert exchange's token blocks: rank p's block of rows starts after the blocks of
// ranks 0..p-1 (tokens_P: their sizes). Shared by the exchange's row kernels.
#pragma once
#include <cstdint>

namespace moe::cuda {

// Block start of rank p: the sizes of the blocks before it (P is a handful).
__device__ __forceinline__ int64_t block_start(const int32_t* tokens_P, int p) {
  int64_t start = 0;
  for (int q = 0; q < p; ++q) start += tokens_P[q];
  return start;
}

}  // namespace moe::cuda
