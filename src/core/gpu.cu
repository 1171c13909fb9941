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

}  // namespace moe::gpu
