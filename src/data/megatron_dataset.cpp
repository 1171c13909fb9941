#include "data/megatron_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <utility>

#include "core/error.h"

namespace moe {
namespace {

// The arrays follow a 34-byte header: reads go through memcpy, never a misaligned pointer.
template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

struct DtypeInfo {
  uint32_t bytes;
  bool is_signed;
  const char* name;
};

// Megatron's DType codes; 0 bytes: not a token id type.
DtypeInfo dtype_info(uint8_t code) {
  switch (code) {
    case 1: return {1, false, "uint8"};
    case 2: return {1, true, "int8"};
    case 3: return {2, true, "int16"};
    case 4: return {4, true, "int32"};
    case 5: return {8, true, "int64"};
    case 6: return {0, true, "float64"};
    case 7: return {0, true, "float32"};
    case 8: return {2, false, "uint16"};
    default: return {0, false, "unknown"};
  }
}

// A read-only mapping of a whole file; ConfigError naming it when that fails.
struct Mapping {
  void* data = nullptr;
  size_t size = 0;
  Mapping() = default;
  Mapping(Mapping&& o) noexcept : data(std::exchange(o.data, nullptr)), size(o.size) {}
  Mapping& operator=(Mapping&&) = delete;
  ~Mapping() {
    if (data) ::munmap(data, size);
  }
};

Mapping map_file(const std::string& path, std::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) MOE_CONFIG_ERROR("{} '{}': cannot open: {}", what, path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    MOE_CONFIG_ERROR("{} '{}': not a regular file", what, path);
  }
  Mapping m;
  m.size = static_cast<size_t>(st.st_size);
  if (m.size > 0) {
    m.data = ::mmap(nullptr, m.size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m.data == MAP_FAILED) {
      m.data = nullptr;
      ::close(fd);
      MOE_CONFIG_ERROR("{} '{}': cannot mmap: {}", what, path, std::strerror(errno));
    }
  }
  ::close(fd);
  return m;
}

}  // namespace

MegatronIndex parse_megatron_index(std::span<const uint8_t> bytes, std::string_view name, int64_t bin_bytes) {
  auto refuse = [&](const std::string& what) { MOE_CONFIG_ERROR("megatron index '{}': {}", name, what); };
  const size_t size = bytes.size();
  if (size < kMegatronIndexHeaderBytes)
    refuse(fmt::format("truncated: {} bytes, the header alone needs {}", size, kMegatronIndexHeaderBytes));
  const uint8_t* p = bytes.data();
  if (std::memcmp(p, kMegatronIndexMagic, sizeof(kMegatronIndexMagic)) != 0)
    refuse("wrong magic (not a Megatron MMIDIDX index)");
  if (const auto version = load<uint64_t>(p + 9); version != 1)
    refuse(fmt::format("unsupported version {} (this build reads 1)", version));
  MegatronIndex index;
  index.dtype_code = p[17];
  const DtypeInfo dtype = dtype_info(index.dtype_code);
  if (dtype.bytes == 0)
    refuse(fmt::format("dtype code {} ({}) is not an integer token id type", index.dtype_code, dtype.name));
  index.token_bytes = dtype.bytes;
  index.token_signed = dtype.is_signed;
  const auto n = load<uint64_t>(p + 18), m = load<uint64_t>(p + 26);
  // Bounds before any arithmetic on the counts: each entry takes at least 4 bytes.
  const uint64_t room = size - kMegatronIndexHeaderBytes;
  if (n > room / 12 || m > room / 8 || m == 0)
    refuse(fmt::format("truncated or corrupt: {} sequences and {} document index entries do not fit its {} bytes", n,
                       m, size));
  const uint64_t expected = kMegatronIndexHeaderBytes + 12 * n + 8 * m;
  if (size != expected && size != expected + n)  // + n: the modes of multimodal data
    refuse(fmt::format("{}: {} sequences and {} document index entries need {} bytes, the file has {}",
                       size < expected ? "truncated" : "wrong size", n, m, expected, size));
  const uint8_t* sizes = p + kMegatronIndexHeaderBytes;
  const uint8_t* pointers = sizes + 4 * n;
  const uint8_t* doc_index = pointers + 8 * n;
  // Sequences back to back: each pointer is the bytes of the sizes before it.
  std::vector<int64_t> seq_start(static_cast<size_t>(n) + 1, 0);
  for (uint64_t i = 0; i < n; ++i) {
    const auto len = load<int32_t>(sizes + 4 * i);
    if (len < 0) refuse(fmt::format("sequence {} has a negative size {}", i, len));
    const auto pointer = load<int64_t>(pointers + 8 * i);
    if (pointer != seq_start[i] * static_cast<int64_t>(dtype.bytes))
      refuse(fmt::format("sequence {} starts at byte {}, expected {} (the sequences must lie back to back)", i,
                         pointer, seq_start[i] * static_cast<int64_t>(dtype.bytes)));
    seq_start[i + 1] = seq_start[i] + len;
  }
  index.n_sequences = static_cast<int64_t>(n);
  index.n_tokens = seq_start[n];
  if (load<int64_t>(doc_index) != 0) refuse("the document index does not start at sequence 0");
  index.doc_offsets.reserve(static_cast<size_t>(m));
  int64_t previous = 0;
  for (uint64_t d = 0; d < m; ++d) {
    const auto at = load<int64_t>(doc_index + 8 * d);
    if (at < previous || at > static_cast<int64_t>(n))
      refuse(fmt::format("document index entry {} is {}, outside [{}, {}]", d, at, previous, n));
    previous = at;
    index.doc_offsets.push_back(seq_start[static_cast<size_t>(at)]);
  }
  if (previous != static_cast<int64_t>(n))
    refuse(fmt::format("the document index ends at sequence {}, not at the last ({})", previous, n));
  if (bin_bytes >= 0 && bin_bytes != index.n_tokens * static_cast<int64_t>(dtype.bytes))
    refuse(fmt::format("the index describes {} {} ids ({} bytes), the .bin has {} bytes", index.n_tokens, dtype.name,
                       index.n_tokens * static_cast<int64_t>(dtype.bytes), bin_bytes));
  return index;
}

std::string megatron_prefix(const std::string& path) {
  std::error_code ec;
  for (const char* suffix : {".idx", ".bin"})
    if (path.ends_with(suffix)) {
      const std::string prefix = path.substr(0, path.size() - 4);
      return std::filesystem::exists(prefix + ".idx", ec) ? prefix : "";
    }
  return std::filesystem::exists(path + ".idx", ec) ? path : "";
}

MegatronDataset::MegatronDataset(const std::string& path) {
  prefix_ = path;
  for (const char* suffix : {".idx", ".bin"})
    if (path.ends_with(suffix)) prefix_ = path.substr(0, path.size() - 4);
  const std::string idx_path = prefix_ + ".idx", bin_path = prefix_ + ".bin";
  const Mapping idx = map_file(idx_path, "megatron index");  // parsed into index_, then unmapped
  Mapping bin = map_file(bin_path, "megatron dataset");
  index_ = parse_megatron_index({static_cast<const uint8_t*>(idx.data), idx.size}, idx_path,
                                static_cast<int64_t>(bin.size));
  bin_size_ = bin.size;
  bin_map_ = std::exchange(bin.data, nullptr);  // kept: the documents are read from it
}

MegatronDataset::~MegatronDataset() {
  if (bin_map_) ::munmap(bin_map_, bin_size_);
}

void MegatronDataset::copy(int64_t d, int64_t offset, int64_t count, int32_t* out) const {
  const auto* base = static_cast<const uint8_t*>(bin_map_) +
                     static_cast<size_t>(index_.doc_offsets[d] + offset) * index_.token_bytes;
  switch (index_.dtype_code) {
    case 1: for (int64_t i = 0; i < count; ++i) out[i] = base[i]; break;
    case 2: for (int64_t i = 0; i < count; ++i) out[i] = load<int8_t>(base + i); break;
    case 3: for (int64_t i = 0; i < count; ++i) out[i] = load<int16_t>(base + 2 * i); break;
    case 4: for (int64_t i = 0; i < count; ++i) out[i] = load<int32_t>(base + 4 * i); break;
    case 5: for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(load<int64_t>(base + 8 * i)); break;
    case 8: for (int64_t i = 0; i < count; ++i) out[i] = load<uint16_t>(base + 2 * i); break;
    default: MOE_THROW("megatron dataset '{}': dtype code {}", prefix_, index_.dtype_code);
  }
}

std::pair<int64_t, int64_t> MegatronDataset::token_range() const {
  if (range_known_) return range_;
  const auto* base = static_cast<const uint8_t*>(bin_map_);
  const int64_t n = index_.n_tokens;
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  const uint8_t code = index_.dtype_code;
  const uint32_t w = index_.token_bytes;
#pragma omp parallel for reduction(min : lo) reduction(max : hi) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* q = base + static_cast<size_t>(i) * w;
    int64_t v = 0;
    switch (code) {
      case 1: v = *q; break;
      case 2: v = load<int8_t>(q); break;
      case 3: v = load<int16_t>(q); break;
      case 4: v = load<int32_t>(q); break;
      case 5: v = load<int64_t>(q); break;
      default: v = load<uint16_t>(q); break;
    }
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  range_ = n > 0 ? std::pair{lo, hi} : std::pair<int64_t, int64_t>{0, 0};
  range_known_ = true;
  return range_;
}

void MegatronDataset::check_vocabulary(int64_t vocab_size, std::string_view vocab_key) const {
  const auto [lo, hi] = token_range();
  if (lo < 0) MOE_CONFIG_ERROR("megatron dataset '{}.bin': negative token id {}", prefix_, lo);
  if (hi >= vocab_size)
    MOE_CONFIG_ERROR("megatron dataset '{}.bin': token id {} outside the vocabulary of {} ({})", prefix_, hi,
                     vocab_size, vocab_key);
}

}  // namespace moe
