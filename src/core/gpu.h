// The thin GPU runtime layer: error checks, device buffers, streams and events. All
// CUDA runtime calls of the project go through here, so a HIP backend is a new
// implementation of this header, not a rewrite. Include only from .cu files or from
// host code built with MOE_HAVE_CUDA.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "core/error_base.h"

#define MOE_CUDA_CHECK(call)                                                                \
  do {                                                                                      \
    cudaError_t moe_cuda_status_ = (call);                                                  \
    if (moe_cuda_status_ != cudaSuccess) [[unlikely]]                                       \
      ::moe::detail::throw_printf(__FILE__, __LINE__, "CUDA error %s (%s) in %s",          \
                                  cudaGetErrorName(moe_cuda_status_),                       \
                                  cudaGetErrorString(moe_cuda_status_), #call);             \
  } while (0)

// Checks the last kernel launch (configuration errors surface here, not at the launch).
#define MOE_CUDA_CHECK_LAUNCH() MOE_CUDA_CHECK(cudaGetLastError())

namespace moe::gpu {

// A device allocation that did not fit: callers such as the batch controller catch this
// one and retry smaller.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// Number of GPUs visible; 0 when there is no driver or no device (never throws).
int device_count();
// Multiprocessors of the current device.
int multiprocessor_count();
// Device memory in use on the current device (all of it, as cudaMemGetInfo sees it).
size_t device_bytes_in_use();

// An owning device allocation. Moves, never copies.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t count) : count_(count) {
    if (count == 0) return;
    const cudaError_t status = cudaMalloc(&data_, count * sizeof(T));
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky, but clear it so later launch checks don't report it
      data_ = nullptr;
      throw OutOfMemory("CUDA out of memory allocating " + std::to_string(count * sizeof(T)) + " bytes");
    }
    MOE_CUDA_CHECK(status);
  }
  ~DeviceArray() {
    if (data_) cudaFree(data_);
  }
  DeviceArray(DeviceArray&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }
  void upload(const T* host, size_t count) {
    MOE_CHECKF(count <= count_, "upload of %zu elements into %zu", count, count_);
    MOE_CUDA_CHECK(cudaMemcpy(data_, host, count * sizeof(T), cudaMemcpyHostToDevice));
  }
  void download(T* host, size_t count) const {
    MOE_CHECKF(count <= count_, "download of %zu elements from %zu", count, count_);
    MOE_CUDA_CHECK(cudaMemcpy(host, data_, count * sizeof(T), cudaMemcpyDeviceToHost));
  }
  // Every byte set to `byte` (0xff poisons floats and bf16 with NaN).
  void fill_bytes(int byte) { MOE_CUDA_CHECK(cudaMemset(data_, byte, count_ * sizeof(T))); }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

// Page-locked host memory (cudaMallocHost): device-to-host copies into it run at the
// link's speed and asynchronously. Pinning is slow (the pages are touched and locked), so
// owners keep one for reuse. Not initialised.
template <typename T>
class PinnedHostArray {
 public:
  PinnedHostArray() = default;
  explicit PinnedHostArray(size_t count) : count_(count) {
    if (count == 0) return;
    const cudaError_t status = cudaMallocHost(&data_, count * sizeof(T));
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      data_ = nullptr;
      throw OutOfMemory("cannot pin " + std::to_string(count * sizeof(T)) + " bytes of host memory");
    }
    MOE_CUDA_CHECK(status);
  }
  ~PinnedHostArray() {
    if (data_) cudaFreeHost(data_);
  }
  PinnedHostArray(PinnedHostArray&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  PinnedHostArray& operator=(PinnedHostArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  PinnedHostArray(const PinnedHostArray&) = delete;
  PinnedHostArray& operator=(const PinnedHostArray&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace moe::gpu
