#include "data/rank_sliced_source.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

RankSlicedSource::RankSlicedSource(std::unique_ptr<BatchSource> inner, int64_t seq_len, int rank, int world)
    : inner_(std::move(inner)), seq_len_(seq_len), rank_(rank), world_(world) {
  MOE_CHECK(rank >= 0 && rank < world, "rank {} outside a world of {}", rank, world);
}

void RankSlicedSource::next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) {
  const auto all = static_cast<size_t>(batch * world_ * seq_len_);
  inputs_.resize(all);
  targets_.resize(all);
  inner_->next_batch(batch * world_, inputs_.data(), targets_.data());
  const auto S = static_cast<size_t>(seq_len_);
  for (int64_t b = 0; b < batch; ++b) {
    const size_t from = static_cast<size_t>(b * world_ + rank_) * S, to = static_cast<size_t>(b) * S;
    std::copy_n(inputs_.data() + from, S, inputs_BS + to);
    std::copy_n(targets_.data() + from, S, targets_BS + to);
  }
}

}  // namespace moe
