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
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  const size_t span = layer_times_.begin(layer_, stream);
  a2a_->exchange(send, send_counts, recv, recv_counts, dtype);
  layer_times_.end(span, stream);
}

std::vector<double> GpuExpertExchangeOverComm::take_layer_seconds(int layers) {
  return layer_times_.take_seconds(layers);
}

void GpuExpertExchangeOverComm::broadcast(void* data, size_t bytes, int root) {
  // Ordered on the caller's stream: the work enqueued after this waits for the result.
  group_->broadcast_async(data, bytes, DType::u8, root)->wait();
}

int64_t GpuExpertExchangeOverComm::take_bytes_sent() { return std::exchange(bytes_sent_, 0); }
int64_t GpuExpertExchangeOverComm::take_off_node_bytes_sent() { return std::exchange(off_node_bytes_sent_, 0); }

}  // namespace moe::dist
