// metrics.trace: the phases of every step as a Chrome Trace Event file (trace.json in
// metrics.dir), which Perfetto (ui.perfetto.dev) and chrome://tracing open. Events are
// appended and flushed step by step, and the array is closed at the end of the run (also
// when it ends by an exception); a file cut short by a crash still loads, as both
// viewers accept an unterminated array. docs/METRICS.md describes the events.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "obs/metrics.h"

namespace moe {

class TraceWriter {
 public:
  // Creates (truncates) `path`; `pid` is the rank. Throws moe::Error naming the file.
  TraceWriter(const std::string& path, int pid);
  ~TraceWriter();  // close()
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;
  // One "X" (complete) event per span, on a thread named after its track, with the step
  // in its args; flushed.
  void step(int64_t step, const std::vector<PhaseSpan>& spans);
  // Ends the array and the object; nothing is written after it.
  void close();
  const std::string& path() const { return path_; }

 private:
  int track_id(const std::string& track);
  void event(const std::string& json);

  std::string path_;
  FILE* file_ = nullptr;
  int pid_ = 0;
  bool first_ = true;
  std::vector<std::string> tracks_;  // tid - 1 -> name
};

// The file metrics.trace writes in a run's folder: "trace.json", and for a session that
// continues a run after step first_step, "trace.from_step_<first_step>.json".
std::string trace_file_name(int64_t first_step);

}  // namespace moe
