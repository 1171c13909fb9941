// `moe tokenize`: inputs -> token shards, encoded in parallel batches (ParallelEncoder
// below), written in input order (the result does not depend on the thread count). All shards are written under
// temporary names and renamed only when every input was read and encoded, so a failure
// leaves no partial output; shards of an earlier run in the same folder are replaced.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/inputs.h"
#include "data/tokenizer.h"

namespace moe {

struct TokenizeOptions {
  InputOptions input;
  std::string output_dir;
  int threads = 0;                     // 0: all cores
  int64_t shard_tokens = int64_t{1} << 28;  // a new shard starts after this many tokens
  double val_fraction = 0.0;           // > 0: documents chosen by path hash go to val_*.bin
  int64_t batch_bytes = 0;             // text read and encoded at a time; 0: 8 MB per thread
  bool progress = true;                // a progress line on stderr
};

struct TokenizeStats {
  int64_t docs = 0, tokens = 0, bytes = 0, shards = 0;
  double seconds = 0;
};

TokenizeStats tokenize_to_shards(const Tokenizer& tokenizer, const TokenizeOptions& options);

// Encodes batches of documents on several threads. Documents longer than a chunk are cut
// where the tokenizer allows (Tokenizer::find_cuts), so one long document does not hold
// up the batch; the chunks are encoded largest first under a dynamic schedule into
// per-thread buffers that are kept from batch to batch, then concatenated in order. The
// result is exactly that of encoding each document whole, for any thread count.
class ParallelEncoder {
 public:
  ParallelEncoder(const Tokenizer& tokenizer, int threads);  // threads <= 0: all cores
  TokenizedDocuments encode(std::span<const std::string_view> texts);
  TokenizedDocuments encode(std::span<const Document> docs);
  // Into `out`, whose memory is reused (no zero-filling of a fresh array on every batch).
  void encode(std::span<const std::string_view> texts, TokenizedDocuments& out);
  void encode(std::span<const Document> docs, TokenizedDocuments& out);
  // Chunks are about total bytes / (threads * 16), within [chunk_min, chunk_max]; tests
  // set both to force many cuts.
  size_t chunk_min = size_t{8} << 10, chunk_max = size_t{1} << 20;
  int64_t last_chunks() const { return static_cast<int64_t>(chunks_.size()); }  // of the last batch

 private:
  struct Chunk {
    uint32_t doc;
    int32_t thread = -1;  // whose buffer holds the ids
    size_t begin, end;    // bytes of the document
    size_t offset = 0, count = 0;  // ids in that buffer
  };
  struct alignas(64) ThreadBuffer {  // one cache line apart: no false sharing of the vector headers
    std::vector<int32_t> ids;
  };
  const Tokenizer& tokenizer_;
  int threads_;
  std::vector<ThreadBuffer> buffers_;
  std::vector<Chunk> chunks_;
  std::vector<uint32_t> order_;
  std::vector<size_t> cuts_;
  std::vector<std::string_view> views_;
};

}  // namespace moe
