#include "core/gpu.h"

namespace moe::gpu {

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

int multiprocessor_count() {
  int device = 0, sms = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

size_t device_bytes_in_use() {
  size_t free_bytes = 0, total_bytes = 0;
  MOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes - free_bytes;
}

}  // namespace moe::gpu
