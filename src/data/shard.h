// Binary token shards: what `moe tokenize` writes and the loader memory-maps.
//
// Layout (little-endian):
//   [0, 64)   header: magic "MOESHARD", u32 version (1), u32 token bytes (2: uint16 ids,
//             4: uint32 ids), u64 tokens, u64 documents, u64 vocab size, u32 CRC32C of
//             everything after the header, u32 CRC32C of the header's first 44 bytes, zeros
//   tokens    n_tokens ids, padded with zeros to a multiple of 8 bytes
//   index     n_docs + 1 u64 offsets: document d is tokens [index[d], index[d+1])
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/atomic_file.h"
#include "data/corpus.h"
#include "data/file_util.h"

namespace moe {

inline constexpr char kShardMagic[8] = {'M', 'O', 'E', 'S', 'H', 'A', 'R', 'D'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;

// CRC32C (Castagnoli), continuing from `crc` (0 to start).
uint32_t crc32c(uint32_t crc, const void* data, size_t bytes);

// Writes one shard under a temporary name; commit() makes it appear whole.
class ShardWriter {
 public:
  ShardWriter(const std::string& path, int64_t vocab_size);
  void add_document(std::span<const int32_t> tokens);
  void commit();
  int64_t n_tokens() const { return n_tokens_; }

 private:
  AtomicFile file_;
  std::string path_;
  int64_t vocab_size_;
  uint32_t token_bytes_;
  int64_t n_tokens_ = 0;
  uint32_t crc_ = 0;
  std::vector<uint64_t> index_{0};
  std::vector<char> buffer_;
};

// A memory-mapped shard, fully validated on open (size, magic, version, dtype, index,
// checksum). Errors name the file and the problem.
class ShardReader {
 public:
  explicit ShardReader(const std::string& path);
  ~ShardReader();
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  int64_t n_docs() const { return n_docs_; }
  int64_t n_tokens() const { return n_tokens_; }
  int64_t vocab_size() const { return vocab_size_; }
  uint32_t token_bytes() const { return token_bytes_; }
  int64_t doc_size(int64_t d) const { return static_cast<int64_t>(index_[d + 1] - index_[d]); }
  // Copies tokens [offset, offset + count) of document d.
  void copy(int64_t d, int64_t offset, int64_t count, int32_t* out) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  const uint8_t* tokens_ = nullptr;
  const uint64_t* index_ = nullptr;
  int64_t n_docs_ = 0, n_tokens_ = 0, vocab_size_ = 0;
  uint32_t token_bytes_ = 2;
};

// Several shards read as one list of documents, in the given order.
class ShardSet final : public DocumentSource {
 public:
  explicit ShardSet(const std::vector<std::string>& paths);
  // The files `<dir>/<prefix>_*.bin` in name order; ConfigError when there are none.
  static std::vector<std::string> list(const std::string& dir, const std::string& prefix);

  int64_t n_docs() const override { return static_cast<int64_t>(doc_shard_.size()); }
  int64_t doc_size(int64_t d) const override;
  void copy(int64_t d, int64_t offset, int64_t count, int32_t* out) const override;
  int64_t n_tokens() const { return n_tokens_; }
  int64_t vocab_size() const { return vocab_size_; }

 private:
  std::vector<std::unique_ptr<ShardReader>> shards_;
  std::vector<std::pair<int32_t, int64_t>> doc_shard_;  // global doc -> (shard, local doc)
  int64_t n_tokens_ = 0, vocab_size_ = 0;
};

}  // namespace moe
