// `moe tokenize`: inputs -> token shards, encoded in parallel batches, written in input
// order (the result does not depend on the thread count). All shards are written under
// temporary names and renamed only when every input was read and encoded, so a failure
// leaves no partial output; shards of an earlier run in the same folder are replaced.
#pragma once
#include <cstdint>
#include <string>

#include "data/inputs.h"
#include "data/tokenizer.h"

namespace moe {

struct TokenizeOptions {
  InputOptions input;
  std::string output_dir;
  int threads = 0;                     // 0: all cores
  int64_t shard_tokens = int64_t{1} << 28;  // a new shard starts after this many tokens
  double val_fraction = 0.0;           // > 0: documents chosen by path hash go to val_*.bin
  bool progress = true;                // a progress line on stderr
};

struct TokenizeStats {
  int64_t docs = 0, tokens = 0, bytes = 0, shards = 0;
  double seconds = 0;
};

TokenizeStats tokenize_to_shards(const Tokenizer& tokenizer, const TokenizeOptions& options);

}  // namespace moe
