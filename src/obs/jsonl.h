// A run's metrics as JSON Lines: one record per line, each line written whole and
// flushed, so a reader (or `moe report`) sees complete records while training runs.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe {

class JsonlWriter {
 public:
  // Creates (truncates) `path`, or appends to it, creating its directory. Throws
  // moe::Error naming it.
  explicit JsonlWriter(const std::string& path, bool append = false);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const nlohmann::json& record);
  void sync();  // fsync
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  FILE* file_ = nullptr;
};

// Before a run goes on after step k: keeps the records of the metrics file at `path` that
// it will not write again, and drops the rest (rewritten atomically; no file: nothing to
// do). A session starts with a "run" record: those starting at k or later go whole; in
// the others, "step", "alert" and "checkpoint" records after step k, "val" records at or
// after k, and a "summary" past k go. Returns the number of records dropped.
int64_t truncate_metrics_after(const std::string& path, int64_t k);

// Reads every record of a JSONL file. A malformed line throws moe::Error naming
// "path:line"; a last line without its newline (a run killed mid-write) is skipped and
// counted in *truncated_lines.
std::vector<nlohmann::json> read_jsonl(const std::string& path, int* truncated_lines = nullptr);

}  // namespace moe
