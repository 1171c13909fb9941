#include "data/blended_source.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace moe {

BlendedSource::BlendedSource(std::vector<std::unique_ptr<BatchSource>> sources, std::vector<double> weights,
                             uint64_t seed, int64_t seq_len)
    : sources_(std::move(sources)), seed_(seed), seq_len_(seq_len) {
  MOE_CHECK(!sources_.empty() && sources_.size() == weights.size(), "{} sources with {} weights", sources_.size(),
            weights.size());
  double total = 0;
  for (double w : weights) {
    MOE_CHECK(w > 0 && std::isfinite(w), "a source weight must be a number > 0, got {}", w);
    total += w;
  }
  double sum = 0;
  for (double w : weights) cumulative_.push_back((sum += w) / total);
  cumulative_.back() = 1.0;  // rounding cannot leave a draw past the last source
}

int BlendedSource::source_of(uint64_t index) const {
  const double u = CounterRng(seed_, "data.sources.blend").uniform(index);  // in (0, 1)
  const auto k = std::upper_bound(cumulative_.begin(), cumulative_.end(), u) - cumulative_.begin();
  return static_cast<int>(std::min<ptrdiff_t>(k, static_cast<ptrdiff_t>(cumulative_.size()) - 1));
}

void BlendedSource::next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) {
  for (int64_t b = 0; b < batch; ++b) {
    sources_[static_cast<size_t>(source_of(drawn_))]->next_batch(1, inputs_BS + b * seq_len_,
                                                                  targets_BS + b * seq_len_);
    ++drawn_;
  }
}

void BlendedSource::reset() {
  drawn_ = 0;
  for (auto& s : sources_) s->reset();
}

std::vector<int64_t> BlendedSource::state() const {
  std::vector<int64_t> state{static_cast<int64_t>(drawn_)};
  for (const auto& s : sources_) {
    const std::vector<int64_t> own = s->state();
    state.push_back(static_cast<int64_t>(own.size()));
    state.insert(state.end(), own.begin(), own.end());
  }
  return state;
}

void BlendedSource::restore(const std::vector<int64_t>& state) {
  // Parsed whole before anything changes: a state that does not fit leaves this source as it was.
  std::vector<std::vector<int64_t>> own;
  size_t at = 1;
  bool fits = !state.empty() && state[0] >= 0;
  for (size_t k = 0; fits && k < sources_.size(); ++k) {
    fits = at < state.size() && state[at] >= 0 && static_cast<uint64_t>(state[at]) <= state.size() - at - 1;
    if (fits) {
      own.emplace_back(state.begin() + static_cast<ptrdiff_t>(at + 1),
                       state.begin() + static_cast<ptrdiff_t>(at + 1 + static_cast<size_t>(state[at])));
      at += 1 + static_cast<size_t>(state[at]);
    }
  }
  if (!fits || at != state.size())
    MOE_THROW("a saved data position of {} values does not fit a blend of {} sources (data.sources changed?)",
              state.size(), sources_.size());
  for (size_t k = 0; k < sources_.size(); ++k) sources_[k]->restore(own[k]);
  drawn_ = static_cast<uint64_t>(state[0]);
}

}  // namespace moe
