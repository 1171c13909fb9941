// The device's clocks as a kernel reads them: the GPU's nanosecond timer (%globaltimer, one
// clock for every SM) and the id of the SM a thread runs on. Each SM's cycle counter is
// clock64(). core/cuda/sm_clocks.h sets the two against each other.
#pragma once
#include <cstdint>

namespace moe::gpu {

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

__device__ __forceinline__ uint32_t sm_id() {
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}

}  // namespace moe::gpu
