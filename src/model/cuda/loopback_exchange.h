// Expert parallelism over one GPU: every exchange is a device copy on the model's stream.
// The expert-parallel path (count exchange and host plan, token blocks, the receiving
// rank's row layout, partial combines and their sums) then runs whole on one GPU: the
// GPU step tests check it gives the plain step's bits, and `moe bench --ep-loopback`
// times its own kernels apart from any network.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/cuda/gpu_transformer.h"

namespace moe {

class LoopbackExpertExchange final : public GpuExpertExchange {
 public:
  int size() const override { return 1; }
  int rank() const override { return 0; }
  void set_stream(void* stream) override { stream_ = stream; }
  // Throws unless one peer (this rank) sends what it receives.
  void exchange(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                const std::vector<int64_t>& recv_counts, size_t elem_bytes) override;
  void broadcast(void* data, size_t bytes, int root) override;
  int64_t calls() const { return calls_; }

 private:
  void* stream_ = nullptr;
  int64_t calls_ = 0;
};

}  // namespace moe
