// Memory pressure: when a micro-batch does not fit (its planned activation memory is over
// training.memory_limit_mb, or allocating it fails), halve the micro-batch and double the
// accumulation steps, so the global batch in tokens (and with it the optimizer step) stays
// the same, until it fits.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace moe {

struct BatchPlan {
  int64_t micro_batch = 0;          // sequences per micro-batch
  int64_t micro_steps = 0;          // micro-batches per optimizer step
  std::vector<std::string> notes;   // one line per halving, for the log
};

// `bytes_for(batch)`: the planned bytes of a micro-batch of `batch` sequences.
// `allocate(batch)`: plans it for real; may throw std::bad_alloc or moe::OutOfMemory,
// which also halve.
// Throws moe::Error when even the smallest micro-batch the global batch allows does not fit.
BatchPlan fit_micro_batch(int64_t global_batch_tokens, int64_t seq_len, int64_t micro_batch, size_t limit_bytes,
                          const std::function<size_t(int64_t)>& bytes_for,
                          const std::function<void(int64_t)>& allocate);

}  // namespace moe
