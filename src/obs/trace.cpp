#include "obs/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moe {

std::string trace_file_name(int64_t first_step) {
  return first_step == 0 ? "trace.json" : fmt::format("trace.from_step_{}.json", first_step);
}

TraceWriter::TraceWriter(const std::string& path, int pid) : path_(path), pid_(pid) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  file_ = std::fopen(path.c_str(), "w");
  if (!file_) throw Error(fmt::format("{}: cannot write the trace: {}", path, std::strerror(errno)));
  std::fputs("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [", file_);
  event(nlohmann::json{{"ph", "M"}, {"name", "process_name"}, {"pid", pid_}, {"args", {{"name", fmt::format("rank {}", pid_)}}}}
            .dump());
  std::fflush(file_);
}

TraceWriter::~TraceWriter() { close(); }

void TraceWriter::event(const std::string& json) {
  std::fputs(first_ ? "\n" : ",\n", file_);
  std::fputs(json.c_str(), file_);
  first_ = false;
}

int TraceWriter::track_id(const std::string& track) {
  auto it = std::find(tracks_.begin(), tracks_.end(), track);
  if (it != tracks_.end()) return static_cast<int>(it - tracks_.begin()) + 1;
  tracks_.push_back(track);
  const int tid = static_cast<int>(tracks_.size());
  // Named threads, listed in the order they first appear.
  event(nlohmann::json{{"ph", "M"}, {"name", "thread_name"}, {"pid", pid_}, {"tid", tid}, {"args", {{"name", track}}}}
            .dump());
  event(nlohmann::json{{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", pid_}, {"tid", tid}, {"args", {{"sort_index", tid}}}}
            .dump());
  return tid;
}

void TraceWriter::step(int64_t step, const std::vector<PhaseSpan>& spans) {
  if (!file_) return;
  for (const PhaseSpan& span : spans) {
    const int tid = track_id(span.track);
    // Microseconds, as the format wants; fractions keep sub-microsecond phases apart.
    nlohmann::json e = {{"name", span.name}, {"cat", span.track}, {"ph", "X"},
                        {"ts", std::round(span.start * 1e9) / 1e3}, {"dur", std::round(std::max(0.0, span.seconds) * 1e9) / 1e3},
                        {"pid", pid_}, {"tid", tid}, {"args", {{"step", step}}}};
    event(e.dump());
  }
  std::fflush(file_);
}

void TraceWriter::close() {
  if (!file_) return;
  std::fputs("\n]}\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

}  // namespace moe
