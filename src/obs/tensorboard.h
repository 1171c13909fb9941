// TensorBoard event files written by hand: TFRecord framing (uint64 length, masked
// CRC32C of the length, the bytes, masked CRC32C of the bytes) around Event protobufs
// (wall_time=1 double, step=2 int64, file_version=3 string, summary=5) whose Summary
// holds Value{tag=1 string, simple_value=2 float}. TensorBoard reads any file whose
// name contains "tfevents".
//
// A resumed run keeps one event file without repeated steps: the events it will not
// write again (scalars of steps <= k, val/loss of steps < k when it goes on after step k)
// are copied from the files already in metrics.dir into a new one, after a SessionLog
// START at step 0 that makes a TensorBoard that is already showing the run forget what it
// loaded, and the old files are removed.
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
// Event{session_log{status: START}}: TensorBoard drops what it holds of steps >= step.
std::string encode_session_start_event(double wall_time, int64_t step);

// What a resumed run needs to know of an event: its step and the tags of its scalars.
struct EventInfo {
  int64_t step = 0;
  bool file_version = false, session_log = false;
  std::vector<std::string> tags;
};
// Parses an Event protobuf (unknown fields skipped); false when it is malformed.
bool parse_event(std::string_view data, EventInfo* info);
// The events of a TFRecord file, up to the first truncated or corrupted record.
std::vector<std::string> read_event_records(const std::string& path);
// One TFRecord: length, crc, data, crc.
std::string frame_record(std::string_view data);

class TensorBoardWriter {
 public:
  // Creates dir/events.out.tfevents.<unix seconds>.<host>.<pid> with its file_version
  // event. A run going on after step `continue_after` first carries over the events of the
  // event files in dir that it will not write again, and removes those files (see above).
  // Throws moe::Error naming the file when it cannot be created.
  explicit TensorBoardWriter(const std::string& dir, int64_t continue_after = 0);
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
