// TensorBoard event files written by hand: TFRecord framing (uint64 length, masked
// CRC32C of the length, the bytes, masked CRC32C of the bytes) around Event protobufs
// (wall_time=1 double, step=2 int64, file_version=3 string, summary=5) whose Summary
// holds Value{tag=1 string, simple_value=2 float}. TensorBoard reads any file whose
// name contains "tfevents".
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moe {

// CRC-32C (Castagnoli), and TFRecord's masking of it.
uint32_t crc32c(const void* data, size_t size);
uint32_t masked_crc32c(const void* data, size_t size);

// Serialized protobufs (exposed for tests).
std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, float>>& scalars);
std::string encode_file_version_event(double wall_time);
// One TFRecord: length, crc, data, crc.
std::string frame_record(std::string_view data);

class TensorBoardWriter {
 public:
  // Creates dir/events.out.tfevents.<unix seconds>.<host> with its file_version event.
  // Throws moe::Error naming the file when it cannot be created.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void add_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
  // Flushes to the OS (each add_scalars call already does) and fsyncs.
  void sync();
  const std::string& path() const { return path_; }

 private:
  void write(const std::string& event);
  std::string path_;
  FILE* file_ = nullptr;
};

}  // namespace moe
