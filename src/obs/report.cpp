#include "obs/report.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"
#include "obs/jsonl.h"
#include "obs/page.h"

namespace moe {
namespace fs = std::filesystem;

nlohmann::json load_run_records(const std::string& jsonl_path, int* truncated_lines) {
  nlohmann::json data = {{"run", nullptr}, {"records", nlohmann::json::array()}, {"done", false}};
  for (auto& record : read_jsonl(jsonl_path, truncated_lines)) {
    const std::string type = record["type"].is_string() ? record["type"].get<std::string>() : "";
    if (type == "run") {
      data["run"] = std::move(record);
    } else {
      if (type == "summary") data["done"] = true;
      data["records"].push_back(std::move(record));
    }
  }
  if (data["run"].is_null()) throw Error(fmt::format("{}: no \"run\" record (is this a moe-train metrics file?)", jsonl_path));
  data["next"] = data["records"].size();
  return data;
}

std::string write_report(const std::string& run_dir, const std::string& output, const std::string& chart_js_path) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) throw ConfigError(fmt::format("{}: not a run directory", run_dir));
  const std::string jsonl = (fs::path(run_dir) / "metrics.jsonl").string();
  if (!fs::exists(jsonl, ec))
    throw ConfigError(fmt::format("{}: no metrics.jsonl (train with --metrics.dir={} to write one)", run_dir, run_dir));
  const nlohmann::json data = load_run_records(jsonl);
  const std::string chart_js = chart_js_path.empty() ? embedded_chart_js() : read_chart_js(chart_js_path);
  const std::string path = output.empty() ? (fs::path(run_dir) / "report.html").string() : output;
  write_file_atomic(path, report_page(data, chart_js));
  return path;
}

}  // namespace moe
