#include "obs/tensorboard.h"

#include <unistd.h>

#include <algorithm>
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

std::string encode_session_start_event(double wall_time, int64_t step) {
  std::string session_log;
  put_key(session_log, 1, 0);  // SessionLog.status = START
  put_varint(session_log, 1);
  std::string event = event_header(wall_time, step);
  put_bytes(event, 7, session_log);  // Event.session_log
  return event;
}

namespace {

// A protobuf reader over one message: fields one at a time.
class WireReader {
 public:
  explicit WireReader(std::string_view data) : data_(data) {}
  bool done() const { return pos_ >= data_.size(); }
  bool varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) return false;
      const auto byte = static_cast<uint8_t>(data_[pos_++]);
      *v |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if (!(byte & 0x80)) return true;
    }
    return false;
  }
  // The next field: number, wire type, and for length-delimited ones their bytes.
  bool field(int* number, int* wire_type, uint64_t* value, std::string_view* bytes) {
    uint64_t key = 0;
    if (!varint(&key)) return false;
    *number = static_cast<int>(key >> 3);
    *wire_type = static_cast<int>(key & 7);
    switch (*wire_type) {
      case 0: return varint(value);
      case 1: return skip(8);
      case 5: return skip(4);
      case 2: {
        uint64_t length = 0;
        if (!varint(&length) || length > data_.size() - pos_) return false;
        *bytes = data_.substr(pos_, length);
        pos_ += length;
        return true;
      }
      default: return false;
    }
  }

 private:
  bool skip(size_t n) {
    if (n > data_.size() - pos_) return false;
    pos_ += n;
    return true;
  }
  std::string_view data_;
  size_t pos_ = 0;
};

}  // namespace

bool parse_event(std::string_view data, EventInfo* info) {
  *info = EventInfo{};
  WireReader event(data);
  while (!event.done()) {
    int number = 0, wire = 0;
    uint64_t value = 0;
    std::string_view bytes;
    if (!event.field(&number, &wire, &value, &bytes)) return false;
    if (number == 2 && wire == 0) info->step = static_cast<int64_t>(value);
    if (number == 3 && wire == 2) info->file_version = true;
    if (number == 7 && wire == 2) info->session_log = true;
    if (number != 5 || wire != 2) continue;
    WireReader summary(bytes);  // Summary: repeated Value{tag = 1}
    while (!summary.done()) {
      std::string_view value_bytes;
      if (!summary.field(&number, &wire, &value, &value_bytes)) return false;
      if (number != 1 || wire != 2) continue;
      WireReader v(value_bytes);
      while (!v.done()) {
        std::string_view tag;
        if (!v.field(&number, &wire, &value, &tag)) return false;
        if (number == 1 && wire == 2) info->tags.emplace_back(tag);
      }
    }
  }
  return true;
}

std::vector<std::string> read_event_records(const std::string& path) {
  FILE* file = std::fopen(path.c_str(), "rb");
  if (!file) throw Error(fmt::format("{}: cannot open TensorBoard event file: {}", path, std::strerror(errno)));
  std::vector<std::string> events;
  while (true) {
    uint64_t length = 0;
    uint32_t length_crc = 0, data_crc = 0;
    if (std::fread(&length, sizeof length, 1, file) != 1 || std::fread(&length_crc, sizeof length_crc, 1, file) != 1 ||
        length_crc != masked_crc32c(&length, sizeof length) || length > (uint64_t{1} << 30))
      break;
    std::string data(length, '\0');
    if (std::fread(data.data(), 1, length, file) != length || std::fread(&data_crc, sizeof data_crc, 1, file) != 1 ||
        data_crc != masked_crc32c(data.data(), data.size()))
      break;  // a run killed mid-record: what follows is not an event
    events.push_back(std::move(data));
  }
  std::fclose(file);
  return events;
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

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t continue_after) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(fmt::format("metrics.dir: cannot create '{}': {}", dir, ec.message()));
  std::vector<fs::path> earlier;  // event files of earlier sessions, in TensorBoard's (name) order
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string().find("tfevents") != std::string::npos) earlier.push_back(entry.path());
  std::sort(earlier.begin(), earlier.end());
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  const double now = unix_now();
  path_ = (fs::path(dir) / fmt::format("events.out.tfevents.{}.{}.{}", static_cast<int64_t>(now), host, getpid()))
              .string();
  // Built under a temporary name (TensorBoard reads only names holding "tfevents"): the
  // earlier files are removed only once it is complete.
  const std::string building = (fs::path(dir) / fmt::format(".tmp.events.{}", getpid())).string();
  file_ = std::fopen(building.c_str(), "wb");
  if (!file_) throw Error(fmt::format("{}: cannot create TensorBoard event file: {}", building, std::strerror(errno)));
  write(encode_file_version_event(now));
  if (!earlier.empty()) {
    write(encode_session_start_event(now, 0));
    for (const fs::path& file : earlier)
      for (const std::string& event : read_event_records(file.string())) {
        EventInfo info;
        if (!parse_event(event, &info) || info.file_version || info.session_log) continue;
        const bool validation = !info.tags.empty() && info.tags[0].starts_with("val/");
        if (validation ? info.step < continue_after : info.step <= continue_after) write(event);
      }
  }
  sync();
  if (std::rename(building.c_str(), path_.c_str()) != 0)
    throw Error(fmt::format("{}: cannot rename into place: {}", building, std::strerror(errno)));
  for (const fs::path& file : earlier)
    if (file != fs::path(path_)) fs::remove(file, ec);
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
