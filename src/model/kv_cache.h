// The keys and values of one sequence for incremental decoding: per attention layer, K
// (after RoPE) and V of positions 0..length-1, n_kv_heads wide (GQA), so that each new
// token attends to its prefix without recomputing it. docs/GENERATION.md.
#pragma once
#include <cstdint>
#include <vector>

#include "config/model_config.h"
#include "core/error.h"

namespace moe {

template <typename T>
class KvCache {
 public:
  // Room for `capacity` positions (at most model.seq_len: RoPE positions stay those trained).
  KvCache(const ModelConfig& config, int64_t capacity)
      : capacity_(capacity), row_(config.n_kv_heads * config.head_dim()) {
    MOE_CHECK(capacity > 0 && capacity <= config.seq_len, "a KV cache of {} positions (model.seq_len {})", capacity,
              config.seq_len);
    const auto size = static_cast<size_t>(capacity * row_);
    k_L_SGd_.assign(static_cast<size_t>(config.n_layers), std::vector<T>(size));
    v_L_SGd_.assign(static_cast<size_t>(config.n_layers), std::vector<T>(size));
  }
  int64_t capacity() const { return capacity_; }
  int64_t length() const { return length_; }
  // Positions [length, length + n) were written into every layer.
  void advance(int64_t n) {
    MOE_CHECK(n >= 0 && length_ + n <= capacity_, "KV cache: {} + {} positions past its {}", length_, n, capacity_);
    length_ += n;
  }
  void clear() { length_ = 0; }
  T* keys(int64_t layer) { return k_L_SGd_[static_cast<size_t>(layer)].data(); }
  T* values(int64_t layer) { return v_L_SGd_[static_cast<size_t>(layer)].data(); }

 private:
  int64_t capacity_, row_, length_ = 0;
  std::vector<std::vector<T>> k_L_SGd_, v_L_SGd_;
};

}  // namespace moe
