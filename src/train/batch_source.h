// Where the trainer's token batches come from. The packed text loader is one source;
// tests feed synthetic tasks through the same interface.
#pragma once
#include <cstdint>

namespace moe {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Fills `batch` sequences: inputs_BS and targets_BS, each [batch, seq_len].
  virtual void next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) = 0;
  // Back to the first batch (validation reads the same held-out batches every time).
  virtual void reset() = 0;
};

}  // namespace moe
