#include "data/loader.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/rng.h"

namespace moe {

PackedLoader::PackedLoader(const DocumentSource& docs, int32_t eos_id, int64_t seq_len, uint64_t seed,
                           bool shuffle, int64_t rank, int64_t world_size)
    : docs_(&docs), eos_id_(eos_id), rank_(rank), world_size_(world_size), seq_len_(seq_len), seed_(seed),
      shuffle_(shuffle) {
  MOE_CHECK(docs.n_docs() > 0, "the loader needs at least one document");
  MOE_CHECK(seq_len > 0, "seq_len must be positive, got {}", seq_len);
  MOE_CHECK(world_size > 0 && rank >= 0 && rank < world_size, "rank {} is not in [0, world_size {})", rank, world_size);
  if (const auto* flat = dynamic_cast<const TokenizedDocuments*>(&docs))
    MOE_CHECK(flat->doc_offsets.front() == 0 && flat->doc_offsets.back() == flat->n_tokens(),
              "doc_offsets do not cover the token array");
  tokens_per_epoch_ = docs.n_docs();
  for (int64_t d = 0; d < docs.n_docs(); ++d) tokens_per_epoch_ += docs.doc_size(d);
  row_.resize(static_cast<size_t>(seq_len + 1));
}

std::vector<int64_t> PackedLoader::epoch_order(int64_t epoch) const {
  const int64_t n = docs_->n_docs();
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  if (!shuffle_) return order;
  // Fisher-Yates; draw i picks from [0, i] with a 64-bit multiply-shift (bias < 2^-32).
  CounterRng rng(seed_, "data.order.epoch" + std::to_string(epoch));
  for (int64_t i = n - 1; i > 0; --i) {
    auto w = rng.bits(static_cast<uint64_t>(i));
    uint64_t r = (static_cast<uint64_t>(w[0]) << 32) | w[1];
    auto j = static_cast<int64_t>((static_cast<unsigned __int128>(r) * static_cast<uint64_t>(i + 1)) >> 64);
    std::swap(order[i], order[j]);
  }
  return order;
}

const PackedLoader::EpochView& PackedLoader::view(int64_t epoch) {
  for (const EpochView& v : views_)
    if (v.epoch == epoch) return v;
  // Replace the older slot: sequences move forward, so the newer one is still useful.
  EpochView& v = views_[0].epoch < views_[1].epoch ? views_[0] : views_[1];
  v.epoch = epoch;
  v.order = epoch_order(epoch);
  v.starts.resize(v.order.size() + 1);
  v.starts[0] = 0;
  for (size_t i = 0; i < v.order.size(); ++i) v.starts[i + 1] = v.starts[i] + docs_->doc_size(v.order[i]) + 1;
  return v;
}

void PackedLoader::copy_stream(int64_t epoch, int64_t position, int64_t count, int32_t* out) {
  while (count > 0) {
    if (position >= tokens_per_epoch_) {
      position -= tokens_per_epoch_;
      ++epoch;
      continue;
    }
    const EpochView& v = view(epoch);
    // The document whose span [starts[i], starts[i+1]) holds `position`.
    size_t i = static_cast<size_t>(std::upper_bound(v.starts.begin(), v.starts.end(), position) - v.starts.begin()) - 1;
    const int64_t size = docs_->doc_size(v.order[i]);
    int64_t within = position - v.starts[i];
    int64_t n = 1;
    if (within < size) {
      n = std::min<int64_t>(count, size - within);
      docs_->copy(v.order[i], within, n, out);
    } else {
      *out = eos_id_;  // the last slot of a document's span is its EOS
    }
    out += n;
    position += n;
    count -= n;
  }
}

void PackedLoader::next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS, int32_t* doc_ids_BS) {
  for (int64_t b = 0; b < batch; ++b) {
    copy_stream(state_.epoch, state_.position + rank_ * seq_len_, seq_len_ + 1, row_.data());
    std::copy_n(row_.begin(), seq_len_, inputs_BS + b * seq_len_);
    std::copy_n(row_.begin() + 1, seq_len_, targets_BS + b * seq_len_);
    if (doc_ids_BS) {
      int32_t doc = 0;
      for (int64_t s = 0; s < seq_len_; ++s) {
        doc_ids_BS[b * seq_len_ + s] = doc;
        if (row_[s] == eos_id_) ++doc;  // the token after an EOS starts the next document
      }
    }
    state_.position += seq_len_ * world_size_;
    state_.epoch += state_.position / tokens_per_epoch_;
    state_.position %= tokens_per_epoch_;
  }
}

void PackedLoader::restore(const LoaderState& state) {
  if (state.epoch < 0 || state.position < 0 || state.position >= tokens_per_epoch_)
    MOE_THROW("loader state (epoch {}, position {}) does not fit a corpus of {} stream tokens per epoch",
              state.epoch, state.position, tokens_per_epoch_);
  state_ = state;
}

}  // namespace moe
