// The dashboard page (web/dashboard.{html,js,css} and Chart.js, compiled into the binary) in its two
// forms: the live page, which links its scripts and polls the server, and the
// self-contained report file, which inlines Chart.js, the page's code and the data.
#pragma once
#include <cstddef>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace moe {

namespace web {
extern const char* const kDashboardHtml;
extern const char* const kDashboardJs;
extern const char* const kDashboardCss;
// Chart.js, read from Debian's libjs-chart.js at build time (cmake/embed_file.cmake).
extern const char kChartJs[];
extern const std::size_t kChartJs_size;
}  // namespace web

// The Chart.js compiled into the binary.
std::string embedded_chart_js();
// Chart.js's source from a file; throws moe::Error naming the file when it is missing.
std::string read_chart_js(const std::string& path);
// The page served by `moe train --dashboard`: the records so far inlined (`data`, as
// MetricsFeed::since answers), then polling api/metrics for the rest.
std::string live_page(const nlohmann::json& data);
// One HTML file with everything inlined; `data` is {"run": ..., "records": [...], "done": ...}.
std::string report_page(const nlohmann::json& data, const std::string& chart_js);

}  // namespace moe
