#include "data/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/error.h"

namespace moe {

namespace fs = std::filesystem;

std::string read_file_prefix(const std::string& path, int64_t limit, std::string_view what) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) MOE_CONFIG_ERROR("{} '{}' does not exist", what, path);
  if (fs::is_directory(status)) MOE_CONFIG_ERROR("{} '{}' is a directory, expected a file", what, path);
  if (ec) MOE_CONFIG_ERROR("{} '{}' cannot be read: {}", what, path, ec.message());
  // A FIFO would block the open until someone writes to it; devices are no documents.
  if (!fs::is_regular_file(status)) MOE_CONFIG_ERROR("{} '{}' is not a regular file", what, path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) MOE_CONFIG_ERROR("{} '{}' cannot be opened: {}", what, path, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::string text;
  char buffer[1 << 16];
  while (static_cast<int64_t>(text.size()) < limit) {
    const size_t want = static_cast<size_t>(std::min<int64_t>(sizeof(buffer), limit - static_cast<int64_t>(text.size())));
    const ssize_t n = ::read(fd, buffer, want);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) MOE_CONFIG_ERROR("{} '{}' cannot be read: {}", what, path, std::strerror(errno));
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  return text;
}

std::string read_whole_file(const std::string& path, std::string_view what) {
  return read_file_prefix(path, std::numeric_limits<int64_t>::max(), what);
}

std::vector<std::pair<std::string, std::string>> list_files_under(const std::string& root, std::string_view extension,
                                                                  std::string_view what) {
  std::vector<std::pair<std::string, std::string>> found;
  std::vector<fs::path> pending{fs::path(root)};
  while (!pending.empty()) {
    const fs::path dir = std::move(pending.back());
    pending.pop_back();
    std::error_code ec;
    fs::directory_iterator it(dir, ec), end;
    if (ec) MOE_CONFIG_ERROR("{}: cannot read '{}': {}", what, dir.string(), ec.message());
    for (; it != end; it.increment(ec)) {
      const fs::path& path = it->path();
      const fs::file_status own = it->symlink_status(ec);
      if (ec) MOE_CONFIG_ERROR("{}: cannot read '{}': {}", what, path.string(), ec.message());
      if (fs::is_directory(own)) {  // not through a symlink: a link cycle cannot loop
        pending.push_back(path);
        continue;
      }
      if (!path.filename().string().ends_with(extension)) continue;
      const fs::file_status target = it->status(ec);  // through a symlink
      if (ec)
        MOE_CONFIG_ERROR("{}: cannot read '{}': {}{}", what, path.string(), ec.message(),
                         fs::is_symlink(own) && target.type() == fs::file_type::not_found ? " (a broken symbolic link)"
                                                                                           : "");
      if (fs::is_regular_file(target)) found.emplace_back(path.lexically_relative(root).generic_string(), path.string());
    }
    if (ec) MOE_CONFIG_ERROR("{}: cannot read '{}': {}", what, dir.string(), ec.message());
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace moe
