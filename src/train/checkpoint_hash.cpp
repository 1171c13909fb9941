#include "train/checkpoint_hash.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"

namespace moe {
namespace fs = std::filesystem;

namespace {

// FNV-1a 64 as earlier checkpoints were hashed: its offset basis lacks the standard one's
// last digit (14695981039346656037), kept so those checkpoints still verify.
struct Fnv1a64 {
  uint64_t h = 1469598103934665603ull;
  void update(const void* data, size_t size) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  }
};

// One interface over both algorithms for streaming.
class Hasher {
 public:
  explicit Hasher(HashAlgorithm algorithm) : algorithm_(algorithm) {
    if (algorithm_ == HashAlgorithm::Xxh3_64) {
      xxh_ = XXH3_createState();
      MOE_CHECK(xxh_ != nullptr && XXH3_64bits_reset(xxh_) == XXH_OK, "XXH3: cannot create a hash state");
    }
  }
  ~Hasher() {
    if (xxh_) XXH3_freeState(xxh_);
  }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void update(const void* data, size_t size) {
    if (xxh_)
      XXH3_64bits_update(xxh_, data, size);
    else
      fnv_.update(data, size);
  }
  std::string hex() const { return fmt::format("{:016x}", xxh_ ? XXH3_64bits_digest(xxh_) : fnv_.h); }

 private:
  HashAlgorithm algorithm_;
  XXH3_state_t* xxh_ = nullptr;
  Fnv1a64 fnv_;
};

}  // namespace

struct StreamHash::State {
  explicit State(HashAlgorithm algorithm) : hasher(algorithm) {}
  Hasher hasher;
};
StreamHash::StreamHash(HashAlgorithm algorithm) : state_(new State(algorithm)) {}
StreamHash::~StreamHash() { delete state_; }
void StreamHash::update(const void* data, size_t size) { state_->hasher.update(data, size); }
std::string StreamHash::hex() const { return state_->hasher.hex(); }

const char* hash_algorithm_name(HashAlgorithm algorithm) {
  return algorithm == HashAlgorithm::Xxh3_64 ? "xxh3_64" : "fnv1a64";
}

HashAlgorithm hash_algorithm_from_name(const std::string& name) {
  if (name == "xxh3_64") return HashAlgorithm::Xxh3_64;
  if (name == "fnv1a64") return HashAlgorithm::Fnv1a64;
  MOE_THROW("unknown checksum algorithm '{}' (this build knows xxh3_64, fnv1a64)", name);
}

std::string content_hash(const void* data, size_t size, HashAlgorithm algorithm) {
  if (algorithm == HashAlgorithm::Xxh3_64) return fmt::format("{:016x}", XXH3_64bits(data, size));
  Hasher hasher(algorithm);
  hasher.update(data, size);
  return hasher.hex();
}

std::string file_hash(const std::filesystem::path& path, HashAlgorithm algorithm, uint64_t* bytes) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (!file) MOE_THROW("{}: cannot open for reading: {}", path.string(), std::strerror(errno));
  Hasher hasher(algorithm);
  std::vector<char> block(size_t{16} << 20);
  uint64_t total = 0;
  for (;;) {
    const size_t n = std::fread(block.data(), 1, block.size(), file);
    hasher.update(block.data(), n);
    total += n;
    if (n < block.size()) break;
  }
  const bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) MOE_THROW("{}: read failed", path.string());
  if (bytes) *bytes = total;
  return hasher.hex();
}

}  // namespace moe
