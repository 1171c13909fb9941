#include "dist/cuda/gpu_expert_exchange.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "core/gpu.h"

namespace moe::dist {

GpuExpertExchangeOverComm::GpuExpertExchangeOverComm(Communicator& world, int ep_size, AllToAllKind kind,
                                                     int ranks_per_node) {
  MOE_CHECK(world.device_memory(), "the GPU's expert parallelism needs a device-memory backend (nccl), got '{}'",
            world.backend());
  MOE_CHECK(ep_size >= 1 && world.size() % ep_size == 0, "expert-parallel size {} does not divide {} ranks", ep_size,
            world.size());
  MOE_CHECK(ranks_per_node >= 1, "{} ranks per node", ranks_per_node);
  group_ = world.split(world.rank() / ep_size, world.rank());
  a2a_ = make_all_to_all(kind, *group_, world.rank() / ranks_per_node);
  if (ep_size > ranks_per_node) ep_ranks_per_node_ = ranks_per_node;
}

void GpuExpertExchangeOverComm::exchange(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                         const std::vector<int64_t>& recv_counts, size_t elem_bytes) {
  MOE_CHECK(elem_bytes == 2 || elem_bytes == 4, "expert exchange: {}-byte elements (2: bf16, 4: int32)", elem_bytes);
  const DType dtype = elem_bytes == 2 ? DType::bf16 : DType::i32;
  for (size_t p = 0; p < send_counts.size(); ++p)
    if (static_cast<int>(p) != group_->rank()) {
      bytes_sent_ += send_counts[p] * static_cast<int64_t>(elem_bytes);
      if (elem_bytes == 2 && ep_ranks_per_node_ > 0 &&
          static_cast<int>(p) / ep_ranks_per_node_ != group_->rank() / ep_ranks_per_node_)
        off_node_bytes_sent_ += send_counts[p] * 2;
    }
  if (!time_layers_ || layer_ < 0) {
    a2a_->exchange(send, send_counts, recv, recv_counts, dtype);
    return;
  }
  if (used_ == timings_.size()) {
    Timing t;
    cudaEvent_t start = nullptr, stop = nullptr;
    MOE_CUDA_CHECK(cudaEventCreate(&start));
    MOE_CUDA_CHECK(cudaEventCreate(&stop));
    t.start = start;
    t.stop = stop;
    timings_.push_back(t);
  }
  Timing& t = timings_[used_++];
  t.layer = layer_;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  MOE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(t.start), stream));
  a2a_->exchange(send, send_counts, recv, recv_counts, dtype);
  MOE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(t.stop), stream));
}

GpuExpertExchangeOverComm::~GpuExpertExchangeOverComm() {
  for (Timing& t : timings_) {
    cudaEventDestroy(static_cast<cudaEvent_t>(t.start));
    cudaEventDestroy(static_cast<cudaEvent_t>(t.stop));
  }
}

std::vector<double> GpuExpertExchangeOverComm::take_layer_seconds(int layers) {
  std::vector<double> seconds(static_cast<size_t>(std::max(layers, 0)), 0.0);
  for (size_t i = 0; i < used_; ++i) {
    const Timing& t = timings_[i];
    MOE_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(t.stop)));
    float ms = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(t.start), static_cast<cudaEvent_t>(t.stop)));
    if (t.layer >= 0 && t.layer < layers) seconds[static_cast<size_t>(t.layer)] += static_cast<double>(ms) * 1e-3;
  }
  used_ = 0;
  return seconds;
}

void GpuExpertExchangeOverComm::broadcast(void* data, size_t bytes, int root) {
  // Ordered on the caller's stream: the work enqueued after this waits for the result.
  group_->broadcast_async(data, bytes, DType::u8, root)->wait();
}

int64_t GpuExpertExchangeOverComm::take_bytes_sent() { return std::exchange(bytes_sent_, 0); }
int64_t GpuExpertExchangeOverComm::take_off_node_bytes_sent() { return std::exchange(off_node_bytes_sent_, 0); }

}  // namespace moe::dist
