// The [checkpoint] section (docs/CONFIG.md describes every key).
#pragma once
#include <cstdint>
#include <string>

namespace moe {

struct CheckpointConfig {
  std::string dir = "";               // "" : no checkpoints
  int64_t interval = 0;               // steps between checkpoints; 0: only at the end
  int64_t keep_last = 3;              // newest checkpoints kept on disk (>= 1)
  bool async = false;                 // write on a background thread; training stalls only for the copy
};

}  // namespace moe
