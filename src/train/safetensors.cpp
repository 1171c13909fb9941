#include "train/safetensors.h"

#include <fmt/format.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/atomic_file.h"

namespace moe {
namespace {

using json = nlohmann::json;

// Headers larger than this are refused before allocating (the Rust reference uses 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

[[noreturn]] void bad(const std::string& source, uint64_t offset, const std::string& what) {
  throw Error(fmt::format("{}: not a valid safetensors file: at byte {}: {}", source, offset, what));
}

uint64_t read_u64_le(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// A JSON value shortened for a message.
std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', true, json::error_handler_t::replace);
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

}  // namespace

int64_t SafeTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t safetensors_dtype_size(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

namespace {

// The header length prefix of a file of file_size bytes, checked.
uint64_t header_length(std::string_view prefix, uint64_t file_size, const std::string& source) {
  if (file_size < 8 || prefix.size() < 8)
    bad(source, 0, fmt::format("file is {} bytes, shorter than the 8-byte header length", file_size));
  const uint64_t header_len = read_u64_le(prefix.data());
  if (header_len > kMaxHeaderBytes)
    bad(source, 0, fmt::format("header length {} exceeds the {}-byte limit", header_len, kMaxHeaderBytes));
  if (header_len > file_size - 8)
    bad(source, 0, fmt::format("header length {} runs past the end of the {}-byte file", header_len, file_size));
  return header_len;
}

// `head`: the file's first 8 + header length bytes (at least); the data section is checked
// against file_size without being read.
SafeTensorsHeader parse_header(std::string_view head, uint64_t file_size, const std::string& source) {
  const uint64_t header_len = header_length(head, file_size, source);
  const std::string_view text = head.substr(8, header_len);
  if (text.empty() || text.front() != '{') bad(source, 8, "header does not start with '{'");
  const json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) bad(source, 8, "header is not valid JSON");
  if (!root.is_object()) bad(source, 8, "header is not a JSON object");

  SafeTensorsHeader header;
  header.data_start = 8 + header_len;
  const uint64_t data_size = file_size - header.data_start;
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) bad(source, 8, "__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) bad(source, 8, fmt::format("__metadata__ '{}' is not a string", key));
        header.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = fmt::format("tensor '{}'", name);
    if (!entry.is_object()) bad(source, 8, where + " is not an object");
    const auto dtype = entry.find("dtype");
    const auto shape = entry.find("shape");
    const auto offsets = entry.find("data_offsets");
    if (dtype == entry.end() || shape == entry.end() || offsets == entry.end())
      bad(source, 8, where + " lacks one of dtype, shape, data_offsets");
    SafeTensorInfo info;
    info.name = name;
    if (!dtype->is_string() || safetensors_dtype_size(dtype->get<std::string>()) == 0)
      bad(source, 8, fmt::format("{}: unknown dtype {}", where, shown(*dtype)));
    info.dtype = dtype->get<std::string>();
    if (!shape->is_array()) bad(source, 8, fmt::format("{}: shape {} is not an array", where, shown(*shape)));
    uint64_t numel = 1;
    for (const json& dim : *shape) {
      if (!dim.is_number_unsigned())
        bad(source, 8, fmt::format("{}: shape entry {} is not a non-negative integer", where, shown(dim)));
      const uint64_t d = dim.get<uint64_t>();
      if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) || __builtin_mul_overflow(numel, d, &numel))
        bad(source, 8, fmt::format("{}: shape {} overflows", where, shown(*shape)));
      info.shape.push_back(static_cast<int64_t>(d));
    }
    if (!offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned())
      bad(source, 8, fmt::format("{}: data_offsets {} is not [begin, end]", where, shown(*offsets)));
    info.begin = (*offsets)[0].get<uint64_t>();
    info.end = (*offsets)[1].get<uint64_t>();
    if (info.begin > info.end || info.end > data_size)
      bad(source, 8, fmt::format("{}: data_offsets [{}, {}] do not lie within the {}-byte data section", where,
                                 info.begin, info.end, data_size));
    uint64_t expected = 0;
    if (__builtin_mul_overflow(numel, safetensors_dtype_size(info.dtype), &expected) ||
        expected != info.end - info.begin)
      bad(source, 8, fmt::format("{}: {} {} needs {} bytes, data_offsets give {}", where, info.dtype, shown(*shape),
                                 expected, info.end - info.begin));
    header.tensors.push_back(std::move(info));
  }
  // The data section is exactly the tensors, back to back, without overlap or holes.
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const SafeTensorInfo& a, const SafeTensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  uint64_t expected_begin = 0;
  for (const SafeTensorInfo& info : header.tensors) {
    if (info.begin != expected_begin)
      bad(source, header.data_start + std::min(info.begin, expected_begin),
          fmt::format("tensor '{}' starts at data offset {}, expected {} (overlap or hole)", info.name, info.begin,
                      expected_begin));
    expected_begin = info.end;
  }
  if (expected_begin != data_size)
    bad(source, header.data_start + expected_begin,
        fmt::format("{} bytes after the last tensor (file truncated or padded?)", data_size - expected_begin));
  return header;
}

}  // namespace

SafeTensorsHeader parse_safetensors_header(std::string_view bytes, const std::string& source) {
  return parse_header(bytes, bytes.size(), source);
}

SafeTensorsHeader read_safetensors_header(int fd, const std::string& source, std::string* header_bytes) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) MOE_THROW("{}: cannot stat: {}", source, std::strerror(errno));
  const auto file_size = static_cast<uint64_t>(st.st_size);
  std::string head(8, '\0');
  read_exactly(fd, head.data(), std::min<uint64_t>(8, file_size), 0, source);
  const uint64_t header_len = header_length(head, file_size, source);
  head.resize(8 + header_len);
  read_exactly(fd, head.data() + 8, header_len, 8, source);
  SafeTensorsHeader header = parse_header(head, file_size, source);
  if (header_bytes) *header_bytes = std::move(head);
  return header;
}

void read_exactly(int fd, void* out, uint64_t count, uint64_t offset, const std::string& source) {
  auto* p = static_cast<char*>(out);
  while (count > 0) {
    const ssize_t n = ::pread(fd, p, std::min<uint64_t>(count, uint64_t{1} << 30), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) MOE_THROW("{}: read failed at byte {}: {}", source, offset, std::strerror(errno));
    if (n == 0) MOE_THROW("{}: ends before byte {} (truncated?)", source, offset + count);
    p += n;
    offset += static_cast<uint64_t>(n);
    count -= static_cast<uint64_t>(n);
  }
}

SafeTensorsFile SafeTensorsFile::read(const std::filesystem::path& path) {
  return from_bytes(read_file_bytes(path), path.string());
}

SafeTensorsFile SafeTensorsFile::from_bytes(std::string bytes, std::string source) {
  SafeTensorsFile file;
  file.header_ = parse_safetensors_header(bytes, source);
  file.bytes_ = std::move(bytes);
  file.source_ = std::move(source);
  for (size_t i = 0; i < file.header_.tensors.size(); ++i) file.index_[file.header_.tensors[i].name] = i;
  return file;
}

const SafeTensorInfo& SafeTensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) MOE_THROW("{}: no tensor '{}'", source_, name);
  return header_.tensors[it->second];
}

void SafeTensorsFile::read_f32(const std::string& name, float* out, int64_t count) const {
  const SafeTensorInfo& t = info(name);
  if (t.dtype != "F32") MOE_THROW("{}: tensor '{}' is {}, expected F32", source_, name, t.dtype);
  if (t.numel() != count)
    MOE_THROW("{}: tensor '{}' has {} elements, expected {}", source_, name, t.numel(), count);
  if (count == 0) return;  // `out` may be null for an empty tensor (memcpy forbids that)
  std::memcpy(out, bytes_.data() + header_.data_start + t.begin, static_cast<size_t>(count) * sizeof(float));
}

const std::string& SafeTensorsFile::metadata(const std::string& key) const {
  auto it = header_.metadata.find(key);
  if (it == header_.metadata.end()) MOE_THROW("{}: metadata key '{}' is missing", source_, key);
  return it->second;
}

void SafeTensorsWriter::add(std::string name, std::string dtype, std::vector<int64_t> shape, const void* data) {
  const size_t element = safetensors_dtype_size(dtype);
  MOE_CHECK(element > 0, "unknown safetensors dtype '{}'", dtype);
  MOE_CHECK(name != "__metadata__", "tensor name __metadata__ is reserved");
  for (const Entry& e : tensors_) MOE_CHECK(e.name != name, "tensor '{}' added twice", name);
  size_t bytes = element;
  for (int64_t d : shape) {
    MOE_CHECK(d >= 0, "tensor '{}' has a negative dimension", name);
    bytes *= static_cast<size_t>(d);
  }
  tensors_.push_back({std::move(name), std::move(dtype), std::move(shape), data, bytes});
  data_bytes_ += bytes;
}

std::string SafeTensorsWriter::header_bytes() const {
  json root = json::object();
  if (!metadata_.empty()) root["__metadata__"] = metadata_;
  size_t offset = 0;
  for (const Entry& e : tensors_) {
    root[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes}}};
    offset += e.bytes;
  }
  std::string text = root.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  return out + text;
}

void SafeTensorsWriter::write(const std::filesystem::path& path, int threads) const {
  const std::string header = header_bytes();
  std::vector<ByteChunk> chunks{{header.data(), header.size()}};
  for (const Entry& e : tensors_) chunks.push_back({e.data, e.bytes});
  write_file_atomic(path, chunks, threads);
}

}  // namespace moe
