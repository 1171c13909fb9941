// Expert parallelism on the CPU path: the MoE layer's row exchange over an all-to-all
// (ExpertExchangeOverComm, one per MoE layer, placing rows by moe/expert_placement.h) and
// the data-parallel sums the MoE layer needs for the global aux loss and capacity
// (BatchGroupOverComm).
//
// Exchange of one MoE layer pass (forward: x rows out, y rows back; backward: dy out,
// dx back), with C = parallel.a2a_chunks:
//   plan   every rank sends each EP peer its row counts per (chunk, expert of that peer):
//          one small all-to-all. Chunk c of expert e's rows is the c-th of C near-equal
//          contiguous slices of them.
//   run    dispatch(0); for c: dispatch(c + 1) starts, chunk c is awaited, the experts
//          compute it, combine(c) starts; then every combine is awaited and unpacked. So
//          the exchange of chunk c + 1 is in flight while chunk c is computed.
// Received rows of a chunk are packed by source rank, then by the receiver's expert slot.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/comm_stats.h"
#include "dist/communicator.h"
#include "model/moe_layer.h"
#include "moe/expert_placement.h"

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
  // a2a spans the EP group; `placement` must outlive this (it is read at every plan()).
  ExpertExchangeOverComm(AllToAll& a2a, const ExpertPlacement& placement, int chunks, CommStats& stats);
  int64_t plan(const int32_t* counts_E, const int32_t* offsets_E1) override;
  int chunks() const override { return chunks_; }
  const std::vector<ExpertSegment>& segments(int chunk) const override {
    return chunk_plans_[static_cast<size_t>(chunk)].segments;
  }
  void run(const void* in_RD, void* recv_RD, const void* result_RD, void* out_RD, int64_t width,
           size_t elem_bytes, const std::function<void(int chunk)>& compute) override;

 private:
  struct ChunkPlan {
    std::vector<int32_t> send_rows;          // layer-layout rows in send order (by peer, then slot)
    std::vector<int64_t> send_rows_to;       // rows to each peer
    std::vector<int64_t> recv_rows_from;     // rows from each peer
    int64_t recv_first = 0, recv_rows = 0;   // where the chunk's received rows start, and how many
    std::vector<ExpertSegment> segments;
  };
  AllToAll& a2a_;
  const ExpertPlacement& placement_;
  int chunks_;
  CommStats& stats_;
  int me_ = 0, peers_ = 1;
  std::vector<ChunkPlan> chunk_plans_;
};

}  // namespace moe::dist
