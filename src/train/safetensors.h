// The safetensors format (Hugging Face): an 8-byte little-endian header length N, N
// bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
// "__metadata__": {"key": "value"}}, then the raw little-endian data; offsets are
// relative to the end of the header. The reader trusts nothing: every length, offset
// and shape is checked against the file before any byte is touched (fuzzed by
// fuzz/fuzz_safetensors.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

struct SafeTensorInfo {
  std::string name;
  std::string dtype;            // "F32", "I64", ... (see safetensors_dtype_size)
  std::vector<int64_t> shape;   // empty: a scalar
  uint64_t begin = 0, end = 0;  // byte range within the data section
  int64_t numel() const;
};

struct SafeTensorsHeader {
  std::vector<SafeTensorInfo> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;              // file offset of the data section
};

// Bytes per element of a safetensors dtype name; 0 when the name is not one.
size_t safetensors_dtype_size(std::string_view dtype);

// Parses and validates the header of a complete file image (`bytes`). Throws moe::Error
// with one line naming `source`, the byte offset and what is wrong.
SafeTensorsHeader parse_safetensors_header(std::string_view bytes, const std::string& source);

// The header of the open file `fd`, read with pread (the data section is not read; its
// size is checked against the file's). `header_bytes`: the bytes read (length prefix
// included), for a hash. Throws as above.
SafeTensorsHeader read_safetensors_header(int fd, const std::string& source, std::string* header_bytes = nullptr);

// pread of exactly `count` bytes at `offset`; throws naming `source` when the file is shorter.
void read_exactly(int fd, void* out, uint64_t count, uint64_t offset, const std::string& source);

// A whole safetensors file read into memory, its header validated.
class SafeTensorsFile {
 public:
  static SafeTensorsFile read(const std::filesystem::path& path);
  static SafeTensorsFile from_bytes(std::string bytes, std::string source);

  const SafeTensorsHeader& header() const { return header_; }
  const std::string& source() const { return source_; }
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  const SafeTensorInfo& info(const std::string& name) const;  // throws when absent
  // Copies tensor `name` into out[0..count), checking its dtype and element count.
  void read_f32(const std::string& name, float* out, int64_t count) const;
  // Metadata value; throws naming the key when absent.
  const std::string& metadata(const std::string& key) const;

 private:
  std::string source_;
  std::string bytes_;
  SafeTensorsHeader header_;
  std::map<std::string, size_t> index_;
};

// Collects tensors (pointers kept until write(), not copied) and writes one file.
class SafeTensorsWriter {
 public:
  void add(std::string name, std::string dtype, std::vector<int64_t> shape, const void* data);
  void add_f32(std::string name, std::vector<int64_t> shape, const float* data) {
    add(std::move(name), "F32", std::move(shape), data);
  }
  void set_metadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }
  size_t data_bytes() const { return data_bytes_; }
  size_t tensor_count() const { return tensors_.size(); }
  // The header bytes (length prefix included) for the tensors added so far.
  std::string header_bytes() const;
  // Writes atomically (temporary name, fsync, rename).
  void write(const std::filesystem::path& path, int threads = 1) const;  // threads: write_file_atomic's

 private:
  struct Entry {
    std::string name, dtype;
    std::vector<int64_t> shape;
    const void* data;
    size_t bytes;
  };
  std::vector<Entry> tensors_;
  std::map<std::string, std::string> metadata_;
  size_t data_bytes_ = 0;
};

}  // namespace moe
