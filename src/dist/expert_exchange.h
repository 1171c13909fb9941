// Expert parallelism on the CPU path: the MoE layer's transport over an all-to-all
// (ExpertExchangeOverComm, one per MoE layer; what travels is decided by
// model/expert_parallel_dispatcher.h) and the data-parallel sums the MoE layer needs for
// the global aux loss and capacity (BatchGroupOverComm).
//
// round_trip with C = parallel.a2a_chunks: chunk c of every peer's block of token rows
// (moe::chunk_of_block) is packed by peer and sent; dispatch(0); for c: dispatch(c + 1)
// starts, chunk c is awaited and unpacked, compute(c) runs, the chunk's results start back;
// then every return is awaited and unpacked. So the exchange of chunk c + 1 is in flight
// while chunk c is computed. The hierarchical all-to-all is blocking, so it does not overlap.
// The speculative dispatch (docs/ROUTING_CACHE.md) adds start_exchange (one exchange_async
// in flight until its wait()) and return_trip (round_trip without the rows' way out).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dist/comm_stats.h"
#include "dist/communicator.h"
#include "model/moe_layer.h"

namespace moe::dist {

class AllToAll;

// MoEBatchGroup over a communicator spanning the data-parallel ranks.
class BatchGroupOverComm final : public MoEBatchGroup {
 public:
  BatchGroupOverComm(Communicator& comm, CommStats& stats) : comm_(comm), stats_(stats) {}
  int size() const override { return comm_.size(); }
  int rank() const override { return comm_.rank(); }
  void sum(double* values, int64_t count) override;
  void all_gather(const int64_t* values, int64_t count, int64_t* all) override;

 private:
  Communicator& comm_;
  CommStats& stats_;
};

class ExpertExchangeOverComm final : public ExpertExchange {
 public:
  // a2a spans the EP group. ep_ranks_per_node: EP ranks per node when the group spans
  // nodes (EP rank r on node r / it), for stats.a2a_off_node_bytes; 0: one node.
  ExpertExchangeOverComm(AllToAll& a2a, int chunks, CommStats& stats, int ep_ranks_per_node = 0);
  int size() const override { return peers_; }
  int rank() const override { return me_; }
  int chunks() const override { return chunks_; }
  void all_gather(const int32_t* values, int64_t count, int32_t* all) override;
  void exchange(const void* send, const std::vector<int64_t>& send_bytes_P, void* recv,
                const std::vector<int64_t>& recv_bytes_P) override;
  void round_trip(const void* send, const std::vector<int64_t>& send_rows_P, void* recv,
                  const std::vector<int64_t>& recv_rows_P, const void* result, void* back, size_t row_bytes,
                  const std::function<void(int chunk)>& compute) override;
  std::unique_ptr<ExchangeInFlight> start_exchange(const void* send, const std::vector<int64_t>& send_bytes_P,
                                                   void* recv, const std::vector<int64_t>& recv_bytes_P) override;
  void return_trip(const std::vector<int64_t>& send_rows_P, const std::vector<int64_t>& recv_rows_P,
                   const void* result, void* back, size_t row_bytes,
                   const std::function<void(int chunk)>& compute) override;
  // Seconds this layer's exchanges blocked since the last call (part of CommStats::wait_s;
  // parallel.a2a_compression = auto picks layers by it).
  double take_wait_s() { return std::exchange(wait_s_, 0.0); }
  // Of those, the seconds the forwards' dispatches blocked (while dispatching(): the
  // plan's exchanges and the waits for token rows, not for results), since the last call.
  double take_dispatch_wait_s() { return std::exchange(dispatch_wait_s_, 0.0); }

 private:
  class InFlight;
  double wait_s_ = 0, dispatch_wait_s_ = 0;
  // Adds a blocked time to the stats, the layer's wait and, while dispatching (or for a
  // round trip's rows), the dispatch wait.
  void blocked(double seconds, bool dispatch);
  // round_trip(), or with send == nullptr the return_trip() of rows already in recv.
  void trip(const void* send, const std::vector<int64_t>& send_rows_P, void* recv,
            const std::vector<int64_t>& recv_rows_P, const void* result, void* back, size_t row_bytes,
            const std::function<void(int chunk)>& compute);
  int64_t remote_bytes(const std::vector<int64_t>& bytes_P) const;
  int64_t off_node_bytes(const std::vector<int64_t>& bytes_P) const;
  AllToAll& a2a_;
  int chunks_;
  CommStats& stats_;
  int me_ = 0, peers_ = 1;
  int ep_ranks_per_node_ = 0;
};

}  // namespace moe::dist
