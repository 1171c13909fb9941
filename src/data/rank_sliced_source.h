// One rank's share of a data-parallel run's batches.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "data/batch_source.h"

namespace moe {

// Rank `rank` of `world` reads sequences k * world + rank of `inner` (which it reads
// whole, world sequences per sequence returned): the ranks' slices are disjoint and
// together are the single-process stream. The position (state) is inner's, the same on
// every rank.
class RankSlicedSource final : public BatchSource {
 public:
  RankSlicedSource(std::unique_ptr<BatchSource> inner, int64_t seq_len, int rank, int world);
  void next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) override;
  void reset() override { inner_->reset(); }
  std::vector<int64_t> state() const override { return inner_->state(); }
  void restore(const std::vector<int64_t>& state) override { inner_->restore(state); }

 private:
  std::unique_ptr<BatchSource> inner_;
  int64_t seq_len_;
  int rank_, world_;
  std::vector<int32_t> inputs_, targets_;
};

}  // namespace moe
