// Packs documents into fixed-length training sequences. The token stream of one epoch
// is doc EOS doc EOS ... with documents in a seeded per-epoch order; epochs follow each
// other without a gap. Sequence i covers stream tokens [i*S, i*S + S] (S+1 tokens:
// inputs are the first S, targets the last S), so no token is wasted and the position
// is one number that a checkpoint can store.
//
// Data parallelism: with (rank, world_size), rank r reads stream sequences
// k * world_size + r, so the ranks' slices are disjoint and together are exactly the
// single-rank stream. The state is the same global position on every rank.
#pragma once
#include <cstdint>
#include <vector>

#include "data/corpus.h"

namespace moe {

// Where the next sequence starts: `position` tokens into epoch `epoch`'s stream.
struct LoaderState {
  int64_t epoch = 0;
  int64_t position = 0;  // in [0, tokens_per_epoch())

  bool operator==(const LoaderState&) const = default;
};

class PackedLoader {
 public:
  // `docs` must outlive the loader and hold at least one document. shuffle=false keeps
  // the documents in their given order every epoch (validation).
  PackedLoader(const DocumentSource& docs, int32_t eos_id, int64_t seq_len, uint64_t seed, bool shuffle,
               int64_t rank = 0, int64_t world_size = 1);
  PackedLoader(TokenizedDocuments&&, int32_t, int64_t, uint64_t, bool, int64_t = 0, int64_t = 1) = delete;  // would dangle

  // Fills inputs_BS and targets_BS (batch * seq_len each, row-major) and advances by
  // batch * seq_len * world_size stream tokens. doc_ids_BS, if given, gets for every
  // input position the index of its document within the row (0, 1, ...: it goes up
  // after each EOS), for document-masked attention.
  void next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS, int32_t* doc_ids_BS = nullptr);

  LoaderState state() const { return state_; }
  // Throws moe::Error if the state does not fit this corpus.
  void restore(const LoaderState& state);
  void reset() { state_ = {}; }

  int64_t seq_len() const { return seq_len_; }
  // Document tokens plus one EOS per document.
  int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  // The order documents are read in during `epoch`: a pure function of (seed, epoch).
  std::vector<int64_t> epoch_order(int64_t epoch) const;

 private:
  // An epoch's document order and where each document starts in that epoch's stream.
  struct EpochView {
    int64_t epoch = -1;
    std::vector<int64_t> order;
    std::vector<int64_t> starts;  // starts[i]: stream offset of order[i]; n_docs + 1 entries
  };

  const EpochView& view(int64_t epoch);
  // Copies `count` stream tokens starting at (epoch, position), crossing epochs as needed.
  void copy_stream(int64_t epoch, int64_t position, int64_t count, int32_t* out);

  const DocumentSource* docs_;
  int32_t eos_id_;
  int64_t rank_, world_size_;
  int64_t seq_len_;
  uint64_t seed_;
  bool shuffle_;
  int64_t tokens_per_epoch_;
  LoaderState state_;
  EpochView views_[2];  // a sequence spans at most a few epochs; two slots avoid rebuilding
  std::vector<int32_t> row_;
};

}  // namespace moe
