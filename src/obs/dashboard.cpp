#include "obs/dashboard.h"

#include <fmt/format.h>
#include <httplib.h>

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/error.h"
#include "obs/page.h"

#include <nlohmann/json.hpp>

namespace moe {

struct Dashboard::Server {
  httplib::Server http;
  std::thread thread;
  std::atomic<bool> finished{false};
  std::string chart_js;
};

Dashboard::Dashboard(int port, const std::string& host) : host_(host), server_(std::make_unique<Server>()) {
  if (port < 0 || port > 65535) throw ConfigError(fmt::format("--dashboard: port must be 0..65535, got {}", port));
  Server& s = *server_;
  s.chart_js = read_chart_js();
  // httplib's default also sets SO_REUSEPORT, which would let a second run bind the same
  // port silently; SO_REUSEADDR alone still allows a restart while the old one lingers.
  s.http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  s.http.Get("/", [this](const httplib::Request&, httplib::Response& res) {
    // The records so far come inlined, so the page draws at once, then polls for more.
    res.set_header("Cache-Control", "no-store");
    res.set_content(live_page(nlohmann::json::parse(feed_.since(0))), "text/html; charset=utf-8");
  });
  s.http.Get("/dashboard.js", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(web::kDashboardJs, "text/javascript; charset=utf-8");
  });
  s.http.Get("/dashboard.css", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(web::kDashboardCss, "text/css; charset=utf-8");
  });
  s.http.Get("/chart.js", [&s](const httplib::Request&, httplib::Response& res) {
    res.set_content(s.chart_js, "text/javascript; charset=utf-8");
  });
  s.http.Get("/api/metrics", [this](const httplib::Request& req, httplib::Response& res) {
    int64_t since = 0;
    if (req.has_param("since")) {
      try {
        since = std::stoll(req.get_param_value("since"));
      } catch (const std::exception&) {
        res.status = 400;
        res.set_content("{\"error\":\"since must be an integer\"}", "application/json");
        return;
      }
    }
    res.set_header("Cache-Control", "no-store");
    res.set_content(feed_.since(since), "application/json");
  });
  port_ = port == 0 ? s.http.bind_to_any_port(host) : (s.http.bind_to_port(host, port) ? port : -1);
  if (port_ <= 0)
    throw Error(fmt::format("--dashboard: cannot listen on {}:{} (in use, or not allowed)", host, port));
  s.thread = std::thread([&s] {
    s.http.listen_after_bind();
    s.finished = true;
  });
  // httplib's stop() does nothing before the server loop runs, so a Dashboard destroyed
  // right after construction would never join: return only once it is running.
  while (!s.http.is_running() && !s.finished) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

Dashboard::~Dashboard() {
  server_->http.stop();
  if (server_->thread.joinable()) server_->thread.join();
}

std::string Dashboard::url() const { return fmt::format("http://{}:{}/", host_, port_); }

}  // namespace moe
