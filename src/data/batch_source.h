// Where the trainer's token batches come from. The packed text loader is one source;
// tests feed synthetic tasks through the same interface.
#pragma once
#include <cstdint>
#include <vector>

#include "core/error.h"

namespace moe {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Fills `batch` sequences: inputs_BS and targets_BS, each [batch, seq_len].
  virtual void next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) = 0;
  // Back to the first batch (validation reads the same held-out batches every time).
  virtual void reset() = 0;
  // The read position as integers, saved in checkpoints so a resumed run reads exactly the
  // batches the uninterrupted run would have. A source without position returns {}.
  virtual std::vector<int64_t> state() const { return {}; }
  // Continues from a state() of a source over the same data; throws moe::Error if it does not fit.
  virtual void restore(const std::vector<int64_t>& state) {
    MOE_CHECK(state.empty(), "this batch source cannot restore a saved position ({} values)", state.size());
  }
};

}  // namespace moe
