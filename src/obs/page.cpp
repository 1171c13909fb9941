#include "obs/page.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace moe {
namespace {

// Replaces the "<!-- NAME ... -->" comment of the template with `text`.
std::string fill_marker(std::string page, const std::string& name, const std::string& text) {
  const size_t start = page.find("<!-- " + name);
  MOE_CHECK(start != std::string::npos, "web/dashboard.html lacks its {} marker", name);
  const size_t end = page.find("-->", start);
  MOE_CHECK(end != std::string::npos, "web/dashboard.html: unterminated {} marker", name);
  return page.replace(start, end + 3 - start, text);
}

// A script's text inside <script>: it must not close the element early.
std::string inline_script(const std::string& code, const std::string& what) {
  std::string lower = code;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower.find("</script") != std::string::npos)
    throw Error(fmt::format("{} contains '</script' and cannot be inlined into the report", what));
  return "<script>\n" + code + "\n</script>";
}

// JSON to place inside <script>: "</" never appears, so no string can end the element.
std::string script_json(const nlohmann::json& data) {
  std::string json = data.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  for (size_t at = json.find("</"); at != std::string::npos; at = json.find("</", at + 3)) json.replace(at, 2, "<\\/");
  return json;
}

}  // namespace

std::string embedded_chart_js() { return {web::kChartJs, web::kChartJs_size}; }

std::string read_chart_js(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot read Chart.js", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string live_page(const nlohmann::json& data) {
  std::string page = fill_marker(web::kDashboardHtml, "MOE_STYLE", "<link rel=\"stylesheet\" href=\"dashboard.css\">");
  return fill_marker(page, "MOE_SCRIPTS",
                     "<script src=\"chart.js\"></script>\n" +
                         inline_script("window.MOE_DATA = " + script_json(data) + ";\nwindow.MOE_LIVE = true;", "the data") +
                         "\n<script src=\"dashboard.js\"></script>");
}

std::string report_page(const nlohmann::json& data, const std::string& chart_js) {
  const std::string json = script_json(data);
  std::string page = fill_marker(web::kDashboardHtml, "MOE_STYLE", std::string("<style>\n") + web::kDashboardCss + "</style>");
  return fill_marker(page, "MOE_SCRIPTS",
              inline_script(chart_js, "Chart.js") + "\n" + inline_script("window.MOE_DATA = " + json + ";", "the data") +
                  "\n" + inline_script(web::kDashboardJs, "web/dashboard.js"));
}

}  // namespace moe
