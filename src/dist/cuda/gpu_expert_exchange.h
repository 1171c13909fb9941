// The GPU model's expert-parallel exchange (GpuExpertExchange) over an NCCL EP group: the
// ranks r with the same r / ep_size (consecutive ranks, so an EP group of up to a node's
// GPUs stays inside the node), flat or hierarchical (parallel.all_to_all).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda/span_timer.h"
#include "dist/communicator.h"
#include "dist/hierarchical_all_to_all.h"
#include "model/cuda/gpu_transformer.h"

namespace moe::dist {

class GpuExpertExchangeOverComm final : public GpuExpertExchange {
 public:
  // Collective over world (an nccl communicator): splits off this rank's EP group.
  // ranks_per_node: the launch's GPUs per node (for the hierarchical exchange).
  GpuExpertExchangeOverComm(Communicator& world, int ep_size, AllToAllKind kind, int ranks_per_node);
  int size() const override { return group_->size(); }
  int rank() const override { return group_->rank(); }
  void set_stream(void* stream) override {
    stream_ = stream;
    a2a_->set_stream(stream);
  }
  void set_layer(int moe_layer) override { layer_ = moe_layer; }
  void exchange(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                const std::vector<int64_t>& recv_counts, size_t elem_bytes) override;
  void broadcast(void* data, size_t bytes, int root) override;
  // Bytes this rank sent to other ranks since the last call, then reset.
  int64_t take_bytes_sent();
  // Of those, the token rows sent to ranks of other nodes, then reset.
  int64_t take_off_node_bytes_sent();
  // With time_layers(true): seconds each of `layers` MoE layers' exchanges took on the
  // stream since the last call (CUDA events around each exchange of a set_layer; waits for
  // them), then reset; what parallel.a2a_compression = auto weighs.
  void time_layers(bool on) { time_layers_ = on; }
  std::vector<double> take_layer_seconds(int layers);

 private:
  std::unique_ptr<Communicator> group_;
  std::unique_ptr<AllToAll> a2a_;
  int64_t bytes_sent_ = 0, off_node_bytes_sent_ = 0;
  int ep_ranks_per_node_ = 0;  // EP ranks per node when the group spans nodes; 0: one node
  void* stream_ = nullptr;
  int layer_ = -1;
  bool time_layers_ = false;
  gpu::SpanTimer layer_times_;  // each exchange of a set_layer, keyed by the layer
};

}  // namespace moe::dist
