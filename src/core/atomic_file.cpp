#include "core/atomic_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace moe {
namespace fs = std::filesystem;

namespace {

// Closes the descriptor on every path out (errors included).
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Writes `bytes` at `offset`; the error text, or "" when all were written.
std::string pwrite_all(int fd, const char* p, size_t bytes, size_t offset) {
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;  // a preemption signal may land mid-write
    if (n <= 0) return n == 0 ? std::string("wrote nothing") : std::strerror(errno);
    p += n, bytes -= static_cast<size_t>(n), offset += static_cast<size_t>(n);
  }
  return {};
}

// A write of up to this many bytes, one per thread at a time.
constexpr size_t kWriteBlock = size_t{64} << 20;

}  // namespace

void write_file_atomic(const fs::path& path, const std::vector<ByteChunk>& chunks, int threads) {
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  const fs::path temp = dir / fmt::format(".{}.tmp.{}", path.filename().string(), ::getpid());
  {
    Fd out{::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
    if (out.fd < 0) MOE_THROW("{}: cannot create: {}", temp.string(), std::strerror(errno));
    // The file cut into blocks of at most kWriteBlock within a chunk, each written at its
    // offset: one thread's write() of host memory into the page cache runs about 2 GB/s.
    struct Block {
      const char* data;
      size_t size, offset;
    };
    std::vector<Block> blocks;
    size_t offset = 0;
    for (const ByteChunk& chunk : chunks)
      for (size_t at = 0; at < chunk.size; at += kWriteBlock) {
        const size_t size = std::min(kWriteBlock, chunk.size - at);
        blocks.push_back({static_cast<const char*>(chunk.data) + at, size, offset});
        offset += size;
      }
    std::vector<std::string> errors(blocks.size());
    const int n = std::max(1, std::min(threads, static_cast<int>(blocks.size())));
#pragma omp parallel for num_threads(n) schedule(dynamic, 1) if (n > 1)
    for (size_t i = 0; i < blocks.size(); ++i) errors[i] = pwrite_all(out.fd, blocks[i].data, blocks[i].size, blocks[i].offset);
    for (const std::string& why : errors)
      if (!why.empty()) {
        ::unlink(temp.c_str());
        MOE_THROW("{}: write failed: {}", temp.string(), why);
      }
    if (::fsync(out.fd) != 0) {
      const std::string why = std::strerror(errno);
      ::unlink(temp.c_str());
      MOE_THROW("{}: fsync failed: {}", temp.string(), why);
    }
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temp.c_str());
    MOE_THROW("{}: rename from {} failed: {}", path.string(), temp.string(), why);
  }
  fsync_directory(dir);
}

void write_file_atomic(const fs::path& path, std::string_view text) {
  write_file_atomic(path, {ByteChunk{text.data(), text.size()}});
}

void fsync_directory(const fs::path& dir) {
  Fd d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (d.fd < 0) MOE_THROW("{}: cannot open directory to fsync: {}", dir.string(), std::strerror(errno));
  if (::fsync(d.fd) != 0) MOE_THROW("{}: fsync of directory failed: {}", dir.string(), std::strerror(errno));
}

std::string read_file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) MOE_THROW("{}: cannot open for reading", path.string());
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) MOE_THROW("{}: read failed", path.string());
  return std::move(bytes).str();
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  temp_ = path_ + ".tmp-" + std::to_string(getpid());
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) MOE_THROW("cannot create '{}': {}", temp_, std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) MOE_THROW("cannot write '{}': {}", temp_, std::strerror(errno));
    p += n, bytes -= static_cast<size_t>(n);
  }
}

void AtomicFile::pwrite(const void* data, size_t bytes, size_t offset) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::pwrite(fd_, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) MOE_THROW("cannot write '{}': {}", temp_, std::strerror(errno));
    p += n, bytes -= static_cast<size_t>(n), offset += static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) MOE_THROW("cannot fsync '{}': {}", temp_, std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  if (::rename(temp_.c_str(), path_.c_str()) != 0) MOE_THROW("cannot rename '{}' to '{}': {}", temp_, path_, std::strerror(errno));
  temp_.clear();
}

}  // namespace moe
