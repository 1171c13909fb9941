#include "train/checkpoint_io.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

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

}  // namespace

void write_file_atomic(const fs::path& path, const std::vector<ByteChunk>& chunks) {
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  const fs::path temp = dir / fmt::format(".{}.tmp.{}", path.filename().string(), ::getpid());
  {
    Fd out{::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
    if (out.fd < 0) MOE_THROW("{}: cannot create: {}", temp.string(), std::strerror(errno));
    for (const ByteChunk& chunk : chunks) {
      const char* p = static_cast<const char*>(chunk.data);
      size_t left = chunk.size;
      while (left > 0) {
        const ssize_t n = ::write(out.fd, p, left);
        if (n < 0 && errno == EINTR) continue;  // a preemption signal may land mid-write
        if (n <= 0) {
          const std::string why = std::strerror(errno);
          ::unlink(temp.c_str());
          MOE_THROW("{}: write failed: {}", temp.string(), why);
        }
        p += n;
        left -= static_cast<size_t>(n);
      }
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

std::string content_hash(const void* data, size_t size) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return fmt::format("{:016x}", h);
}

}  // namespace moe
