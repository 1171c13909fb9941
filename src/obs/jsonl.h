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

// Reads every record of a JSONL file. A malformed line throws moe::Error naming
// "path:line"; a last line without its newline (a run killed mid-write) is skipped and
// counted in *truncated_lines.
std::vector<nlohmann::json> read_jsonl(const std::string& path, int* truncated_lines = nullptr);

}  // namespace moe
