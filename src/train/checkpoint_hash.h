// Checksums of checkpoint files (detect truncation and bit flips).
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace moe {

// As 16 lowercase hex
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

// A hash fed piece by piece: the hash of the pieces' concatenation (a shard's hash while
// it is written, without reading it back).
class StreamHash {
 public:
  explicit StreamHash(HashAlgorithm algorithm = kCheckpointHash);
  ~StreamHash();
  StreamHash(const StreamHash&) = delete;
  StreamHash& operator=(const StreamHash&) = delete;
  void update(const void* data, size_t size);
  std::string hex() const;

 private:
  struct State;
  State* state_;
};

}  // namespace moe
