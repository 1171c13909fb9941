#include "data/shard.h"

#include <fcntl.h>
#include <nmmintrin.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace moe {
namespace {

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;
  uint64_t n_tokens;
  uint64_t n_docs;
  uint64_t vocab_size;
  uint32_t payload_crc;
  uint32_t header_crc;  // of the 44 bytes before it
  char zeros[16];
};
static_assert(sizeof(Header) == kShardHeaderBytes);
constexpr size_t kHeaderCrcBytes = offsetof(Header, header_crc);

size_t padded(size_t bytes) { return (bytes + 7) / 8 * 8; }

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t bytes) {
  // SSE4.2's crc32 instruction computes CRC32C; x86-64-v2 (our baseline) has it.
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  for (; bytes >= 8; p += 8, bytes -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
  }
  auto c32 = static_cast<uint32_t>(c);
  for (; bytes > 0; ++p, --bytes) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}

ShardWriter::ShardWriter(const std::string& path, int64_t vocab_size)
    : file_(path), path_(path), vocab_size_(vocab_size), token_bytes_(vocab_size <= 65536 ? 2 : 4) {
  const char zeros[kShardHeaderBytes] = {};
  file_.write(zeros, sizeof(zeros));  // the header goes in last, once the counts are known
}

void ShardWriter::add_document(std::span<const int32_t> tokens) {
  buffer_.resize(tokens.size() * token_bytes_);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t id = tokens[i];
    MOE_CHECK(id >= 0 && id < vocab_size_, "shard '{}': token id {} outside the vocabulary of {}", path_, id, vocab_size_);
    if (token_bytes_ == 2) {
      auto v = static_cast<uint16_t>(id);
      std::memcpy(buffer_.data() + 2 * i, &v, 2);
    } else {
      auto v = static_cast<uint32_t>(id);
      std::memcpy(buffer_.data() + 4 * i, &v, 4);
    }
  }
  file_.write(buffer_.data(), buffer_.size());
  crc_ = crc32c(crc_, buffer_.data(), buffer_.size());
  n_tokens_ += static_cast<int64_t>(tokens.size());
  index_.push_back(static_cast<uint64_t>(n_tokens_));
}

void ShardWriter::commit() {
  const size_t token_payload = static_cast<size_t>(n_tokens_) * token_bytes_;
  const char zeros[8] = {};
  const size_t pad = padded(token_payload) - token_payload;
  file_.write(zeros, pad);
  crc_ = crc32c(crc_, zeros, pad);
  file_.write(index_.data(), index_.size() * sizeof(uint64_t));
  crc_ = crc32c(crc_, index_.data(), index_.size() * sizeof(uint64_t));
  Header h{};
  std::memcpy(h.magic, kShardMagic, 8);
  h.version = kShardVersion;
  h.token_bytes = token_bytes_;
  h.n_tokens = static_cast<uint64_t>(n_tokens_);
  h.n_docs = index_.size() - 1;
  h.vocab_size = static_cast<uint64_t>(vocab_size_);
  h.payload_crc = crc_;
  h.header_crc = crc32c(0, &h, kHeaderCrcBytes);
  file_.pwrite(&h, sizeof(h), 0);
  file_.commit();
}

ShardReader::ShardReader(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) MOE_CONFIG_ERROR("shard '{}': cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    MOE_THROW("shard '{}': cannot stat: {}", path, std::strerror(errno));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < kShardHeaderBytes) {
    ::close(fd);
    MOE_THROW("shard '{}': truncated: {} bytes, the header alone needs {}", path, size_, kShardHeaderBytes);
  }
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    MOE_THROW("shard '{}': cannot mmap: {}", path, std::strerror(errno));
  }
  const auto* base = static_cast<const uint8_t*>(map_);
  Header h;
  std::memcpy(&h, base, sizeof(h));
  if (std::memcmp(h.magic, kShardMagic, 8) != 0) MOE_THROW("shard '{}': wrong magic (not a moe token shard)", path);
  if (h.version != kShardVersion) MOE_THROW("shard '{}': unsupported version {} (this build reads {})", path, h.version, kShardVersion);
  if (crc32c(0, &h, kHeaderCrcBytes) != h.header_crc) MOE_THROW("shard '{}': header checksum mismatch (corrupt header)", path);
  if (h.token_bytes != 2 && h.token_bytes != 4) MOE_THROW("shard '{}': unsupported token width {} bytes", path, h.token_bytes);
  const size_t token_payload = padded(h.n_tokens * h.token_bytes);
  const size_t expected = kShardHeaderBytes + token_payload + (h.n_docs + 1) * sizeof(uint64_t);
  if (h.n_tokens > (uint64_t{1} << 40) || h.n_docs > (uint64_t{1} << 40) || size_ != expected)
    MOE_THROW("shard '{}': {}: the header promises {} tokens and {} documents ({} bytes), the file has {} bytes", path,
              size_ < expected ? "truncated" : "wrong size", h.n_tokens, h.n_docs, expected, size_);
  if (crc32c(0, base + kShardHeaderBytes, size_ - kShardHeaderBytes) != h.payload_crc)
    MOE_THROW("shard '{}': checksum mismatch (the tokens or index are corrupt)", path);
  tokens_ = base + kShardHeaderBytes;
  index_ = reinterpret_cast<const uint64_t*>(tokens_ + token_payload);
  n_docs_ = static_cast<int64_t>(h.n_docs);
  n_tokens_ = static_cast<int64_t>(h.n_tokens);
  vocab_size_ = static_cast<int64_t>(h.vocab_size);
  token_bytes_ = h.token_bytes;
  if (index_[0] != 0 || index_[n_docs_] != h.n_tokens) MOE_THROW("shard '{}': the document index does not cover the tokens", path);
  for (int64_t d = 0; d < n_docs_; ++d)
    if (index_[d + 1] < index_[d]) MOE_THROW("shard '{}': document index decreases at document {}", path, d);
}

ShardReader::~ShardReader() {
  if (map_) ::munmap(map_, size_);
}

void ShardReader::copy(int64_t d, int64_t offset, int64_t count, int32_t* out) const {
  const uint64_t start = index_[d] + static_cast<uint64_t>(offset);
  if (token_bytes_ == 2) {
    const auto* p = reinterpret_cast<const uint16_t*>(tokens_) + start;
    for (int64_t i = 0; i < count; ++i) out[i] = p[i];
  } else {
    const auto* p = reinterpret_cast<const uint32_t*>(tokens_) + start;
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(p[i]);
  }
}

ShardSet::ShardSet(const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    shards_.push_back(std::make_unique<ShardReader>(path));
    const ShardReader& s = *shards_.back();
    if (shards_.size() > 1 && s.vocab_size() != vocab_size_)
      MOE_THROW("shard '{}': vocabulary size {} differs from {} of '{}'", path, s.vocab_size(), vocab_size_, paths[0]);
    vocab_size_ = s.vocab_size();
    n_tokens_ += s.n_tokens();
    for (int64_t d = 0; d < s.n_docs(); ++d) doc_shard_.emplace_back(static_cast<int32_t>(shards_.size() - 1), d);
  }
}

std::vector<std::string> ShardSet::list(const std::string& dir, const std::string& prefix) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) MOE_CONFIG_ERROR("shard directory '{}' does not exist or is not a directory", dir);
  std::vector<std::string> paths;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(prefix + "_") && name.ends_with(".bin")) paths.push_back(entry.path().string());
  }
  if (paths.empty()) MOE_CONFIG_ERROR("shard directory '{}' has no {}_*.bin shards (write them with moe tokenize)", dir, prefix);
  std::sort(paths.begin(), paths.end());
  return paths;
}

int64_t ShardSet::doc_size(int64_t d) const {
  auto [s, local] = doc_shard_[d];
  return shards_[s]->doc_size(local);
}

void ShardSet::copy(int64_t d, int64_t offset, int64_t count, int32_t* out) const {
  auto [s, local] = doc_shard_[d];
  shards_[s]->copy(local, offset, count, out);
}

}  // namespace moe
