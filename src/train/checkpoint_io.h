// Files that are never half-written: every write goes to a temporary name in the same
// directory, is fsynced, then renamed over the target, and the directory is fsynced so
// the rename itself survives a crash.
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
void write_file_atomic(const std::filesystem::path& path, const std::vector<ByteChunk>& chunks);
void write_file_atomic(const std::filesystem::path& path, std::string_view text);
// fsync a directory so renames and creations inside it are durable.
void fsync_directory(const std::filesystem::path& dir);
// The whole file. Throws moe::Error naming the path when it cannot be read.
std::string read_file_bytes(const std::filesystem::path& path);
// Checksums of checkpoint files (detect truncation and bit flips), as 16 lowercase hex
// digits. XXH3-64 (libxxhash, ~10 GB/s) for what is written now; FNV-1a 64 (byte at a
// time, ~0.7 GB/s) only to read checkpoints written before XXH3.
enum class HashAlgorithm { Fnv1a64, Xxh3_64 };
constexpr HashAlgorithm kCheckpointHash = HashAlgorithm::Xxh3_64;
const char* hash_algorithm_name(HashAlgorithm algorithm);  // "fnv1a64", "xxh3_64"
// Throws moe::Error naming the value when it is not one of the names above.
HashAlgorithm hash_algorithm_from_name(const std::string& name);
std::string content_hash(const void* data, size_t size, HashAlgorithm algorithm = kCheckpointHash);
// The hash of a file read in blocks (never held whole in memory); its size into *bytes.
std::string file_hash(const std::filesystem::path& path, HashAlgorithm algorithm, uint64_t* bytes);

}  // namespace moe
