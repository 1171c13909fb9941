// Files that are never half-written: every write goes to a temporary name in the same
// directory, is fsynced, then renamed over the target, and the directory is fsynced so
// the rename itself survives a crash. The one owner of atomic writes (checkpoints,
// metrics, tokenizers, shards, reports).
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

// One piece of a file's contents (not owned).
struct ByteChunk {
  const void* data = nullptr;
  size_t size = 0;
};

// Writes the chunks, in order, to `path` atomically. Throws moe::Error naming the path.
// `threads` > 1 writes blocks of the file at their offsets on that many threads.
void write_file_atomic(const std::filesystem::path& path, const std::vector<ByteChunk>& chunks, int threads = 1);
void write_file_atomic(const std::filesystem::path& path, std::string_view text);
// fsync a directory so renames and creations inside it are durable.
void fsync_directory(const std::filesystem::path& dir);
// The whole file. Throws moe::Error naming the path when it cannot be read.
std::string read_file_bytes(const std::filesystem::path& path);

// A file written in pieces (shards): to `path.tmp-<pid>`, renamed over `path` by commit().
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
