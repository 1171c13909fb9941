#include "data/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace moe {

std::string read_whole_file(const std::string& path, std::string_view what) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) MOE_CONFIG_ERROR("{} '{}' does not exist", what, path);
  if (std::filesystem::is_directory(path, ec)) MOE_CONFIG_ERROR("{} '{}' is a directory, expected a file", what, path);
  std::ifstream in(path, std::ios::binary);
  if (!in) MOE_CONFIG_ERROR("{} '{}' cannot be opened: {}", what, path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) MOE_THROW("{} '{}': read failed", what, path);
  return ss.str();
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

void write_file_atomic(const std::string& path, std::string_view data) {
  AtomicFile file(path);
  file.write(data.data(), data.size());
  file.commit();
}

}  // namespace moe
