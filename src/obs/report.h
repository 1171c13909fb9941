// `moe report RUN_DIR`: the dashboard page as one self-contained HTML file (Chart.js,
// the page's code and the run's records inlined), built from RUN_DIR/metrics.jsonl.
#pragma once
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace moe {

// {"run": ..., "records": [...], "next": N, "done": bool} from a metrics.jsonl, the
// shape the live server answers with. Throws moe::Error naming "file:line" on bad input.
nlohmann::json load_run_records(const std::string& jsonl_path, int* truncated_lines = nullptr);

// Writes the report for run_dir to `output` (default run_dir/report.html) through a
// temporary file, fsync and rename. Returns the path written. Chart.js comes from
// chart_js_path, or ("") the copy compiled into the binary.
std::string write_report(const std::string& run_dir, const std::string& output = "",
                         const std::string& chart_js_path = "");

}  // namespace moe
