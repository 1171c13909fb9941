// Several batch sources blended by weight (data.sources): each sequence of the stream comes
// from source k with probability weight_k / sum(weights), drawn from a counter-based RNG
// keyed by (seed, sequence number), so the choice is a pure function of the sequence's
// place in the stream: the same on every run and rank count, and after a resume.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "data/batch_source.h"

namespace moe {

class BlendedSource final : public BatchSource {
 public:
  // `weights` positive, one per source; each source fills sequences of `seq_len` tokens.
  BlendedSource(std::vector<std::unique_ptr<BatchSource>> sources, std::vector<double> weights, uint64_t seed,
                int64_t seq_len);
  void next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) override;
  void reset() override;
  // [sequences drawn, then for each source: its state's length and values]: the position
  // in the blend and every source's own position.
  std::vector<int64_t> state() const override;
  void restore(const std::vector<int64_t>& state) override;

  // The source sequence `index` of the stream is drawn from.
  int source_of(uint64_t index) const;
  int64_t sequences() const { return static_cast<int64_t>(drawn_); }

 private:
  std::vector<std::unique_ptr<BatchSource>> sources_;
  std::vector<double> cumulative_;  // normalised, ending at 1
  uint64_t seed_;
  int64_t seq_len_;
  uint64_t drawn_ = 0;
};

}  // namespace moe
