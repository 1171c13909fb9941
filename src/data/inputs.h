// Text inputs of `moe tokenize` and `moe tokenizer train`: files, directories (read
// recursively, in relative-path order) and JSONL files (one document per line, the text
// in a configurable string field). Read in batches so large inputs stream.
#pragma once
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "data/corpus.h"

namespace moe {

struct InputOptions {
  std::vector<std::string> paths;   // files or directories
  std::string extension;            // in directories: only names ending with this ("" : all)
  std::string text_field = "text";  // for .jsonl files
};

class InputReader {
 public:
  // Lists the files up front: ConfigError for a missing path or an empty directory.
  explicit InputReader(InputOptions options);
  // Appends documents until about `max_bytes` of text were read; false when none was left.
  // Document names are the path below the --input directory (so the --val-fraction split
  // matches data.dir's), the file path as given, or "name:line" for JSONL lines. Bad JSONL lines: ConfigError
  // naming file and line.
  bool next(std::vector<Document>& docs, int64_t max_bytes);
  int64_t total_bytes() const { return total_bytes_; }  // of all input files
  int64_t bytes_read() const { return bytes_read_; }

 private:
  InputOptions options_;
  std::vector<std::string> files_;
  std::vector<std::string> names_;  // below the directory given (as data.dir names them), else the path
  size_t file_ = 0;
  std::unique_ptr<std::ifstream> jsonl_;
  int64_t line_ = 0;
  int64_t total_bytes_ = 0, bytes_read_ = 0;
};

// Every document of the inputs at once (tokenizer training).
std::vector<Document> read_all_inputs(const InputOptions& options);

}  // namespace moe
