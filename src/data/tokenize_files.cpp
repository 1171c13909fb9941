#include "data/tokenize_files.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <filesystem>
#include <future>
#include <memory>

#include "core/error.h"
#include "data/shard.h"

namespace fs = std::filesystem;

namespace moe {
namespace {

std::string clock_text(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  return fmt::format("{}m{:02d}s", s / 60, s % 60);
}

// The shards of one split: rolls over to a new file every `limit` tokens.
struct SplitWriter {
  std::string dir, prefix;
  int64_t vocab_size, limit;
  std::vector<std::unique_ptr<ShardWriter>> shards;
  std::vector<std::string> names;

  void add(std::span<const int32_t> tokens) {
    if (shards.empty() || shards.back()->n_tokens() >= limit) {
      names.push_back(fmt::format("{}_{:05d}.bin", prefix, shards.size()));
      shards.push_back(std::make_unique<ShardWriter>((fs::path(dir) / names.back()).string(), vocab_size));
    }
    shards.back()->add_document(tokens);
  }
};

}  // namespace

ParallelEncoder::ParallelEncoder(const Tokenizer& tokenizer, int threads)
    : tokenizer_(tokenizer), threads_(threads > 0 ? threads : omp_get_max_threads()),
      states_(static_cast<size_t>(threads_)) {}

TokenizedDocuments ParallelEncoder::encode(std::span<const std::string_view> texts) {
  TokenizedDocuments out;
  encode(texts, out);
  return out;
}

TokenizedDocuments ParallelEncoder::encode(std::span<const Document> docs) {
  TokenizedDocuments out;
  encode(docs, out);
  return out;
}

void ParallelEncoder::encode(std::span<const Document> docs, TokenizedDocuments& out) {
  views_.clear();
  for (const Document& d : docs) views_.push_back(d.text);
  encode(views_, out);
}

void ParallelEncoder::encode(std::span<const std::string_view> texts, TokenizedDocuments& out) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  const auto entered = Clock::now();
  MOE_CHECK(texts.size() < (size_t{1} << 32), "too many documents in one batch: {}", texts.size());
  size_t total = 0;
  for (std::string_view t : texts) total += t.size();
  const size_t chunk_bytes = std::clamp<size_t>(total / (static_cast<size_t>(threads_) * 16), chunk_min,
                                                std::max(chunk_min, chunk_max));
  chunks_.clear();
  for (size_t d = 0; d < texts.size(); ++d) {
    cuts_.clear();
    if (texts[d].size() > chunk_bytes) tokenizer_.find_cuts(texts[d], chunk_bytes, cuts_);
    size_t begin = 0;
    for (size_t cut : cuts_) {
      MOE_CHECK(cut > begin && cut < texts[d].size(), "tokenizer {}: cut at {} outside ({}, {})", tokenizer_.name(),
                cut, begin, texts[d].size());
      chunks_.push_back({static_cast<uint32_t>(d), begin, cut});
      begin = cut;
    }
    chunks_.push_back({static_cast<uint32_t>(d), begin, texts[d].size()});
  }
  MOE_CHECK(chunks_.size() < (size_t{1} << 32), "too many chunks in one batch: {}", chunks_.size());
  // The schedule: the bulk of the chunks in document order, then a tail of the smallest
  // ones (together >= 4 * threads * the largest chunk), largest first. Whatever bulk chunk
  // a thread takes last, the tail keeps the others busy at least that long, and the last
  // chunks handed out are small, so threads finish together. Document order in the bulk
  // keeps equal texts apart (a corpus repeated N times, sorted by size, would have one
  // thread encode each document N times in a row: unusually cache-friendly).
  // Sort keys: the size (saturated to 32 bits, inverted) above the index.
  constexpr uint64_t kMax32 = 0xffffffffu;
  auto key = [&](size_t k) {
    return (kMax32 - std::min<uint64_t>(chunks_[k].end - chunks_[k].begin, kMax32)) << 32 | k;
  };
  by_size_.resize(chunks_.size());
  for (size_t k = 0; k < chunks_.size(); ++k) by_size_[k] = key(k);
  std::sort(by_size_.begin(), by_size_.end());
  size_t tail = by_size_.size();  // by_size_[tail..] is the tail
  if (threads_ > 1 && !chunks_.empty()) {
    const size_t largest = chunks_[by_size_[0] & kMax32].end - chunks_[by_size_[0] & kMax32].begin;
    const size_t budget = 4 * static_cast<size_t>(threads_) * largest;
    for (size_t bytes = 0; tail > 0 && bytes < budget;) {
      const Chunk& c = chunks_[by_size_[--tail] & kMax32];
      bytes += c.end - c.begin;
    }
  }
  schedule_.clear();
  const uint64_t tail_key = tail < by_size_.size() ? by_size_[tail] : ~uint64_t{0};
  for (size_t k = 0; k < chunks_.size(); ++k)
    if (key(k) < tail_key) schedule_.push_back(static_cast<uint32_t>(k));
  for (size_t i = tail; i < by_size_.size(); ++i) schedule_.push_back(static_cast<uint32_t>(by_size_[i] & kMax32));
  MOE_CHECK(schedule_.size() == chunks_.size(), "schedule of {} chunks holds {}", chunks_.size(), schedule_.size());
  chunk_at_.resize(chunks_.size());
  for (ThreadState& s : states_) s.ids.clear(), s.encoded.clear();  // capacity is kept

  const auto n_chunks = static_cast<int64_t>(chunks_.size());
  std::exception_ptr error;
  const auto forked = Clock::now();
  Clock::time_point encoded, placed;
#pragma omp parallel num_threads(threads_)
  {
    ThreadState& me = states_[static_cast<size_t>(omp_get_thread_num())];
    const auto start = Clock::now();
    const uint64_t misses_before = tokenizer_.cache_misses_on_this_thread();
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t k = 0; k < n_chunks; ++k) {
      const uint32_t c = schedule_[static_cast<size_t>(k)];
      const Chunk& chunk = chunks_[c];
      try {
        const size_t offset = me.ids.size();
        tokenizer_.encode_append(texts[chunk.doc].substr(chunk.begin, chunk.end - chunk.begin), me.ids);
        me.encoded.push_back({c, offset, me.ids.size() - offset});
      } catch (...) {
#pragma omp critical(moe_parallel_encoder_error)
        if (!error) error = std::current_exception();
      }
    }
    me.busy_seconds = seconds(Clock::now() - start);
    me.cache_misses = tokenizer_.cache_misses_on_this_thread() - misses_before;
    tokenizer_.share_this_threads_cache();  // published below, for the next pass
#pragma omp barrier
    // Every chunk is encoded: its place in the output follows from the counts of the chunks
    // before it (chunks_ is in document order). O(chunks), serial, while the others wait.
#pragma omp single
    {
      encoded = Clock::now();
      if (!error) {
        try {
          for (const ThreadState& s : states_)
            for (const Encoded& e : s.encoded) chunk_at_[e.chunk] = static_cast<int64_t>(e.count);
          int64_t total_ids = 0;
          out.doc_offsets.resize(texts.size() + 1);
          out.doc_offsets[0] = 0;
          for (size_t k = 0; k < chunks_.size(); ++k) {
            const int64_t count = chunk_at_[k];
            chunk_at_[k] = total_ids;
            total_ids += count;
            out.doc_offsets[chunks_[k].doc + 1] = total_ids;  // the document's last chunk sets it
          }
          out.tokens.resize(static_cast<size_t>(total_ids));  // zero-fills only growth
          tokenizer_.publish_shared_cache();  // what the threads learnt, for the next pass
        } catch (...) {
          error = std::current_exception();
        }
      }
      placed = Clock::now();
    }  // the implicit barrier publishes the offsets and `error`
    // Each thread copies the chunks it encoded, the last encoded first (still in its cache).
    if (!error) {
      for (auto e = me.encoded.rbegin(); e != me.encoded.rend(); ++e)
        std::copy_n(me.ids.data() + e->offset, e->count, out.tokens.data() + chunk_at_[e->chunk]);
    }
  }
  const auto joined = Clock::now();
  if (error) std::rethrow_exception(error);
  profile_.passes += 1;
  profile_.prep_seconds += seconds(forked - entered);
  profile_.encode_seconds += seconds(encoded - forked);
  for (const ThreadState& s : states_) profile_.busy_seconds += s.busy_seconds, profile_.cache_misses += s.cache_misses;
  profile_.offsets_seconds += seconds(placed - encoded);
  profile_.copy_seconds += seconds(joined - placed);
}

TokenizeStats tokenize_to_shards(const Tokenizer& tokenizer, const TokenizeOptions& options) {
  if (options.shard_tokens <= 0) MOE_CONFIG_ERROR("--shard-tokens must be positive, got {}", options.shard_tokens);
  if (options.val_fraction < 0 || options.val_fraction >= 1)
    MOE_CONFIG_ERROR("--val-fraction must be in [0, 1), got {}", options.val_fraction);
  InputReader reader(options.input);
  std::error_code ec;
  fs::create_directories(options.output_dir, ec);
  if (!fs::is_directory(options.output_dir, ec))
    MOE_CONFIG_ERROR("--output: cannot create directory '{}'", options.output_dir);
  const int threads = options.threads > 0 ? options.threads : omp_get_max_threads();
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };

  SplitWriter train{options.output_dir, "train", tokenizer.vocab_size(), options.shard_tokens};
  SplitWriter val{options.output_dir, "val", tokenizer.vocab_size(), options.shard_tokens};
  TokenizeStats stats;
  auto write = [&](const std::vector<Document>& docs, const TokenizedDocuments& encoded) {
    for (int64_t d = 0; d < encoded.n_docs(); ++d) {
      const bool held_out = options.val_fraction > 0 && is_validation_document(docs[d].relative_path, options.val_fraction);
      (held_out ? val : train).add(encoded.doc(d));
      stats.bytes += static_cast<int64_t>(docs[d].text.size());
    }
    stats.docs += encoded.n_docs();
    stats.tokens += encoded.n_tokens();
  };
  // Batches of ~8 MB per thread bound memory; long documents are cut into chunks, so
  // the batch size does not decide how evenly the threads are loaded. While one batch is
  // encoded, another thread writes the previous one and reads the next, so the serial
  // reading and writing overlap the parallel encoding.
  const int64_t batch_bytes = options.batch_bytes > 0 ? options.batch_bytes : (int64_t{8} << 20) * threads;
  ParallelEncoder encoder(tokenizer, threads);
  std::vector<Document> docs[2];
  TokenizedDocuments encoded[2];
  int64_t encoded_docs = 0, encoded_tokens = 0;  // for the progress line (stats count what was written)
  bool pending_write = false, more = reader.next(docs[0], batch_bytes);
  for (int cur = 0; more; cur = 1 - cur) {
    const int other = 1 - cur;
    const int64_t read_through_cur = reader.bytes_read();  // input bytes up to the end of this batch
    auto background = std::async(std::launch::async, [&, other, pending_write] {
      if (pending_write) write(docs[other], encoded[other]);
      docs[other].clear();
      return reader.next(docs[other], batch_bytes);
    });
    try {
      encoder.encode(docs[cur], encoded[cur]);
    } catch (...) {
      background.wait();
      throw;
    }
    more = background.get();
    pending_write = true;
    encoded_docs += encoded[cur].n_docs(), encoded_tokens += encoded[cur].n_tokens();
    if (options.progress) {
      const double t = elapsed(), done = static_cast<double>(read_through_cur);
      const double total = static_cast<double>(std::max<int64_t>(reader.total_bytes(), 1));
      const double rate = done / std::max(t, 1e-9);
      fmt::print(stderr, "\rtokenize: [{:<30}] {:.1f}/{:.1f} MB | {:.1f} MB/s | eta {} | {} docs, {} tokens",
                 std::string(static_cast<size_t>(30 * std::min(1.0, done / total)), '#'), done / 1e6, total / 1e6,
                 rate / 1e6, clock_text((total - done) / std::max(rate, 1.0)), encoded_docs, encoded_tokens);
    }
    if (!more) write(docs[cur], encoded[cur]);
  }
  if (options.progress) fmt::print(stderr, "\n");
  if (stats.docs == 0) MOE_CONFIG_ERROR("--input: no documents found");
  if (train.shards.empty()) MOE_CONFIG_ERROR("--val-fraction {} left no training documents", options.val_fraction);

  // Everything is encoded: make the new shards appear, then drop shards of an earlier run.
  std::vector<std::string> keep;
  for (SplitWriter* split : {&train, &val}) {
    for (auto& shard : split->shards) shard->commit();
    keep.insert(keep.end(), split->names.begin(), split->names.end());
    stats.shards += static_cast<int64_t>(split->shards.size());
  }
  for (const auto& entry : fs::directory_iterator(options.output_dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours = (name.starts_with("train_") || name.starts_with("val_")) && name.ends_with(".bin");
    if (ours && std::find(keep.begin(), keep.end(), name) == keep.end()) fs::remove(entry.path(), ec);
  }
  stats.seconds = elapsed();
  return stats;
}

}  // namespace moe
