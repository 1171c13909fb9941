#include "obs/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace moe {
namespace {

constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli
    table[i] = c;
  }
  return table;
}
constexpr auto kCrc32cTable = make_crc32c_table();

// Protobuf wire format: varint keys (field << 3 | wire type), little-endian fixed widths.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
void put_key(std::string& out, int field, int wire_type) { put_varint(out, static_cast<uint64_t>(field << 3 | wire_type)); }
template <class T>
void put_fixed(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // x86-64 is little-endian, as the wire format
  out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

std::string event_header(double wall_time, int64_t step) {
  std::string event;
  put_key(event, 1, 1);  // wall_time, fixed64
  put_fixed(event, wall_time);
  if (step != 0) {
    put_key(event, 2, 0);  // step, varint (two's complement for negatives)
    put_varint(event, static_cast<uint64_t>(step));
  }
  return event;
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) c = kCrc32cTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);  // Summary.Value.tag
    put_key(v, 2, 5);      // Summary.Value.simple_value, fixed32
    put_fixed(v, value);
    put_bytes(summary, 1, v);  // Summary.value (repeated)
  }
  std::string event = event_header(wall_time, step);
  put_bytes(event, 5, summary);  // Event.summary
  return event;
}

std::string encode_file_version_event(double wall_time) {
  std::string event = event_header(wall_time, 0);
  put_bytes(event, 3, "brain.Event:2");  // Event.file_version
  return event;
}

std::string frame_record(std::string_view data) {
  std::string out;
  const uint64_t length = data.size();
  put_fixed(out, length);
  put_fixed(out, masked_crc32c(&length, sizeof(length)));
  out.append(data);
  put_fixed(out, masked_crc32c(data.data(), data.size()));
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error(fmt::format("metrics.dir: cannot create '{}': {}", dir, ec.message()));
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  const double now = unix_now();
  path_ = (std::filesystem::path(dir) /
           fmt::format("events.out.tfevents.{}.{}.{}", static_cast<int64_t>(now), host, getpid()))
              .string();
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) throw Error(fmt::format("{}: cannot create TensorBoard event file: {}", path_, std::strerror(errno)));
  write(encode_file_version_event(now));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  write(encode_scalars_event(unix_now(), step, scalars));
}

void TensorBoardWriter::write(const std::string& event) {
  // A whole record per fwrite+fflush: a reader never sees half a record unless we crash.
  const std::string record = frame_record(event);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() || std::fflush(file_) != 0)
    throw Error(fmt::format("{}: write failed: {}", path_, std::strerror(errno)));
}

void TensorBoardWriter::sync() {
  if (std::fflush(file_) != 0 || fsync(fileno(file_)) != 0)
    throw Error(fmt::format("{}: fsync failed: {}", path_, std::strerror(errno)));
}

}  // namespace moe
