#include "data/inputs.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/error.h"
#include "data/file_util.h"
#include "data/jsonl.h"

namespace fs = std::filesystem;

namespace moe {

InputReader::InputReader(InputOptions options) : options_(std::move(options)) {
  if (options_.paths.empty()) MOE_CONFIG_ERROR("--input: no input given");
  for (const std::string& path : options_.paths) {
    std::error_code ec;
    if (!fs::exists(path, ec)) MOE_CONFIG_ERROR("--input: '{}' does not exist", path);
    if (fs::is_directory(path, ec)) {
      const auto found = list_files_under(path, options_.extension, "--input");  // (relative name, path)
      if (found.empty()) MOE_CONFIG_ERROR("--input: no files ending in '{}' under '{}'", options_.extension, path);
      for (auto& [name, file] : found) names_.push_back(name), files_.push_back(file);
    } else {
      if (!fs::is_regular_file(path, ec)) MOE_CONFIG_ERROR("--input: '{}' is not a regular file or a directory", path);
      names_.push_back(path);
      files_.push_back(path);
    }
  }
  for (const std::string& f : files_) total_bytes_ += static_cast<int64_t>(fs::file_size(f));
}

bool InputReader::next(std::vector<Document>& docs, int64_t max_bytes) {
  int64_t got = 0;
  const size_t before = docs.size();
  while (got < max_bytes && file_ < files_.size()) {
    const std::string& path = files_[file_];
    if (!is_jsonl_path(path)) {
      Document doc{names_[file_], read_whole_file(path, "--input:")};
      got += static_cast<int64_t>(doc.text.size());
      bytes_read_ += static_cast<int64_t>(doc.text.size());
      docs.push_back(std::move(doc));
      ++file_;
      continue;
    }
    if (!jsonl_) {
      jsonl_ = std::make_unique<std::ifstream>(path, std::ios::binary);
      if (!*jsonl_) MOE_CONFIG_ERROR("--input: '{}' cannot be opened: {}", path, std::strerror(errno));
      line_ = 0;
    }
    std::string line;
    while (got < max_bytes && std::getline(*jsonl_, line)) {
      ++line_;
      bytes_read_ += static_cast<int64_t>(line.size()) + 1;
      if (is_blank_jsonl_line(line)) continue;
      Document doc{names_[file_] + ":" + std::to_string(line_),
                   jsonl_document(line, options_.text_field, path, line_, "--text-field")};
      got += static_cast<int64_t>(doc.text.size());
      docs.push_back(std::move(doc));
    }
    if (got < max_bytes) {  // end of this file
      if (jsonl_->bad()) MOE_CONFIG_ERROR("--input: '{}' cannot be read: {}", path, std::strerror(errno));
      jsonl_.reset();
      ++file_;
    }
  }
  return docs.size() > before;
}

std::vector<Document> read_all_inputs(const InputOptions& options) {
  InputReader reader(options);
  std::vector<Document> docs;
  while (reader.next(docs, std::numeric_limits<int64_t>::max())) {
  }
  return docs;
}

}  // namespace moe
