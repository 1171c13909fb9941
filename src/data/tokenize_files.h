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
// up the batch; the chunks are encoded under a dynamic schedule (in document order, the
// smallest last, largest first among them) into per-thread buffers that are kept from
// batch to batch. Then, in the same parallel region, one thread turns the chunks' id
// counts into output offsets (a prefix sum) and every thread copies the chunks it encoded
// into place. The result is exactly that of encoding each document whole, for any thread
// count.
class ParallelEncoder {
 public:
  ParallelEncoder(const Tokenizer& tokenizer, int threads);  // threads <= 0: all cores
  TokenizedDocuments encode(std::span<const std::string_view> texts);
  TokenizedDocuments encode(std::span<const Document> docs);
  // Into `out`, whose memory is reused: only growth beyond its previous size is zero-filled.
  void encode(std::span<const std::string_view> texts, TokenizedDocuments& out);
  void encode(std::span<const Document> docs, TokenizedDocuments& out);
  // Chunks are about total bytes / (threads * 16), within [chunk_min, chunk_max]; tests
  // set both to force many cuts.
  size_t chunk_min = size_t{8} << 10, chunk_max = size_t{1} << 20;
  int64_t last_chunks() const { return static_cast<int64_t>(chunks_.size()); }  // of the last batch

  // Where the time of the passes since reset_profile() went (sums; wall seconds unless noted).
  // threads * encode_seconds - busy_seconds is time threads spent idle during the encoding
  // (starting late, or done while others still encoded: the schedule's tail).
  struct Profile {
    int64_t passes = 0;
    double prep_seconds = 0;      // serial: sizes, cuts, schedule order
    double encode_seconds = 0;    // from the fork until the last thread finished encoding
    double busy_seconds = 0;      // summed over threads: time spent encoding chunks
    double offsets_seconds = 0;   // serial: the prefix sum over chunks, sizing the output, sharing caches
    double copy_seconds = 0;      // the parallel copy into place, and the join
    uint64_t cache_misses = 0;    // summed over threads: Tokenizer::cache_misses_on_this_thread's growth
  };
  const Profile& profile() const { return profile_; }
  void reset_profile() { profile_ = {}; }

 private:
  struct Chunk {
    uint32_t doc;
    size_t begin, end;  // bytes of the document
  };
  struct Encoded {  // a chunk's ids in its thread's buffer
    uint32_t chunk;
    size_t offset, count;
  };
  struct alignas(64) ThreadState {  // cache lines of their own: no false sharing between threads
    std::vector<int32_t> ids;       // the ids of this thread's chunks, in the order encoded
    std::vector<Encoded> encoded;
    double busy_seconds = 0;
    uint64_t cache_misses = 0;      // this pass's
  };
  const Tokenizer& tokenizer_;
  int threads_;
  std::vector<ThreadState> states_;
  std::vector<Chunk> chunks_;         // in document order
  std::vector<uint64_t> by_size_;     // (inverted size << 32) | chunk, ascending: largest first
  std::vector<uint32_t> schedule_;    // chunks in the order they are handed out
  std::vector<int64_t> chunk_at_;     // each chunk's first id in the output
  std::vector<size_t> cuts_;
  std::vector<std::string_view> views_;
  Profile profile_;
};

}  // namespace moe
