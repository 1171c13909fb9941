#include "data/tokenize_files.h"

#include <fmt/format.h>
#include <omp.h>

#include <chrono>
#include <filesystem>
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
  std::vector<Document> docs;
  // Batches of ~16 MB per thread keep every core busy and memory bounded.
  const int64_t batch_bytes = int64_t{16} << 20;
  while (reader.next(docs, batch_bytes * threads)) {
    TokenizedDocuments encoded = tokenize_documents(docs, tokenizer, threads);
    for (int64_t d = 0; d < encoded.n_docs(); ++d) {
      const bool held_out = options.val_fraction > 0 && is_validation_document(docs[d].relative_path, options.val_fraction);
      (held_out ? val : train).add(encoded.doc(d));
      stats.bytes += static_cast<int64_t>(docs[d].text.size());
    }
    stats.docs += encoded.n_docs();
    stats.tokens += encoded.n_tokens();
    docs.clear();
    if (options.progress) {
      const double t = elapsed(), done = static_cast<double>(reader.bytes_read());
      const double total = static_cast<double>(std::max<int64_t>(reader.total_bytes(), 1));
      const double rate = done / std::max(t, 1e-9);
      fmt::print(stderr, "\rtokenize: [{:<30}] {:.1f}/{:.1f} MB | {:.1f} MB/s | eta {} | {} docs, {} tokens",
                 std::string(static_cast<size_t>(30 * std::min(1.0, done / total)), '#'), done / 1e6, total / 1e6,
                 rate / 1e6, clock_text((total - done) / std::max(rate, 1.0)), stats.docs, stats.tokens);
    }
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
