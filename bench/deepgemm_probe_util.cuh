// What the DeepGEMM probes share (bench/deepgemm_probe.cu: fp8; bench/deepgemm_bf16_probe.cu:
// bf16): CUDA error checks, device copies, 2-D TMA maps through the driver's entry point
// (no link against libcuda), a launch with a cluster, and the median of CUDA-event timings.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace probe {

#define CHECK_CUDA(call)                                                                                \
  do {                                                                                                  \
    const cudaError_t status_ = (call);                                                                 \
    if (status_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(status_));  \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)

constexpr uint32_t kSms = 132;  // H100 / H200: the kernels are compiled for this count

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(1, host.size()) * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// The driver's cuTensorMapEncodeTiled through the runtime.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiled encode_tiled() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CHECK_CUDA(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
    std::exit(1);
  }
  return reinterpret_cast<EncodeTiled>(fn);
}

// A 2-D map over [outer, inner] (inner contiguous, `pitch` bytes a row), boxes of
// box_outer x box_inner.
inline CUtensorMap map_2d(CUtensorMapDataType type, void* base, uint64_t inner, uint64_t outer, uint64_t pitch,
                          uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {pitch};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, type, 2, base, dims, strides, box, element_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed (%d)\n", static_cast<int>(r));
    std::exit(1);
  }
  return map;
}

// The swizzle mode of a span of `bytes` (128, 64, 32; 0: none).
inline CUtensorMapSwizzle swizzle_of(uint32_t bytes) {
  return bytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
         : bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
         : bytes == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                       : CU_TENSOR_MAP_SWIZZLE_NONE;
}

// A persistent launch over every SM with 128 TMA threads + `math_threads`, clusters of
// `cluster` CTAs.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, uint32_t math_threads, uint32_t cluster, size_t smem, Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(kSms);
  config.blockDim = dim3(128 + math_threads);
  config.dynamicSmemBytes = smem;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, args...));
}

// The median of 20 timed calls (CUDA events) after 3 warm-up calls, in ms.
template <typename F>
double median_ms(F&& call) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) call();
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    call();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

inline void check_device_sms() {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (sms != static_cast<int>(kSms)) {
    std::fprintf(stderr, "deepgemm probe: built for %u SMs, the device has %d\n", kSms, sms);
    std::exit(1);
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out before a hang or a kill
}

}  // namespace probe
