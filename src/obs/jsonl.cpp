#include "obs/jsonl.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/atomic_file.h"

namespace moe {

JsonlWriter::JsonlWriter(const std::string& path, bool append) : path_(path) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) throw Error(fmt::format("metrics.dir: cannot create '{}': {}", parent.string(), ec.message()));
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  if (!file_) throw Error(fmt::format("{}: cannot create metrics file: {}", path, std::strerror(errno)));
}

JsonlWriter::~JsonlWriter() {
  if (file_) std::fclose(file_);
}

void JsonlWriter::write(const nlohmann::json& record) {
  // Non-finite numbers become null (JSON has no NaN); a skipped step keeps its line.
  const std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    throw Error(fmt::format("{}: write failed: {}", path_, std::strerror(errno)));
}

void JsonlWriter::sync() {
  if (std::fflush(file_) != 0 || fsync(fileno(file_)) != 0)
    throw Error(fmt::format("{}: fsync failed: {}", path_, std::strerror(errno)));
}

int64_t truncate_metrics_after(const std::string& path, int64_t k) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return 0;  // a new file
  std::ostringstream text_stream;
  text_stream << in.rdbuf();
  const std::string text = text_stream.str();
  std::string kept;
  int64_t dropped = 0;
  bool session_kept = true;  // lines before any "run" record belong to no session: kept
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    if (end == std::string::npos) {  // a half-written last line
      ++dropped;
      break;
    }
    const std::string_view line(text.data() + start, end + 1 - start);
    start = end + 1;
    const nlohmann::json r = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    bool keep = true;
    if (r.is_object() && r.contains("type") && r["type"].is_string()) {
      const std::string type = r["type"];
      auto number = [&](const char* key) { return r.contains(key) && r[key].is_number() ? r[key].get<int64_t>() : 0; };
      if (type == "run") session_kept = number("first_step") < k;
      keep = session_kept;
      if (type == "step" || type == "alert" || type == "checkpoint") keep = keep && number("step") <= k;
      if (type == "val") keep = keep && number("step") < k;
      if (type == "summary") keep = keep && number("steps") <= k;
    }
    if (keep) kept.append(line);
    else ++dropped;
  }
  if (dropped == 0) return 0;
  write_file_atomic(path, kept);
  return dropped;
}

std::vector<nlohmann::json> read_jsonl(const std::string& path, int* truncated_lines) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open", path));
  std::ostringstream text_stream;
  text_stream << in.rdbuf();
  const std::string text = text_stream.str();
  std::vector<nlohmann::json> records;
  if (truncated_lines) *truncated_lines = 0;
  size_t start = 0;
  int line_number = 0;
  while (start < text.size()) {
    ++line_number;
    const size_t end = text.find('\n', start);
    if (end == std::string::npos) {  // the writer died mid-line
      if (truncated_lines) ++*truncated_lines;
      break;
    }
    const std::string_view line(text.data() + start, end - start);
    start = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded() || !record.is_object() || !record.contains("type"))
      throw Error(fmt::format("{}:{}: not a metrics record (expected a JSON object with a \"type\")", path, line_number));
    records.push_back(std::move(record));
  }
  return records;
}

}  // namespace moe
