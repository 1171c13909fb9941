// Small file helpers of the data pipeline: whole-file reads with errors that name the
// file, and atomic writes (temporary name, fsync, rename).
#pragma once
#include <string>
#include <string_view>

namespace moe {

// Throws ConfigError "<what> '<path>' does not exist / cannot be read".
std::string read_whole_file(const std::string& path, std::string_view what);

// Writes `data` to `path` via `path.tmp-<pid>`, fsyncs and renames; removes the temporary
// file on failure.
void write_file_atomic(const std::string& path, std::string_view data);

// Same, for a payload produced in pieces by `write(fd)`; used for shards.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();  // removes the temporary file unless commit() ran
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t bytes);
  void pwrite(const void* data, size_t bytes, size_t offset);
  void commit();  // fsync, close, rename
  const std::string& temp_path() const { return temp_; }

 private:
  std::string path_, temp_;
  int fd_ = -1;
};

}  // namespace moe
