#include "obs/dashboard.h"

#include <fmt/format.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "obs/page.h"

#include <nlohmann/json.hpp>

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

// A connection gets one request, read within kReadSeconds in all and answered within
// kWriteSeconds: a client that trickles bytes (httplib's own timeouts restart with every
// byte) holds a worker for a bounded time only. Enough workers that a handful of slow
// clients leave the browser's requests a free one.
constexpr auto kReadDeadline = std::chrono::seconds(2);
constexpr auto kWriteDeadline = std::chrono::seconds(10);
constexpr size_t kWorkers = 32;
constexpr size_t kMaxRequestBody = 64 * 1024;  // the dashboard takes GETs only

// A socket stream whose reads and writes fail once their deadline has passed.
class DeadlineStream final : public httplib::Stream {
 public:
  DeadlineStream(int fd, Clock::time_point read_by, Clock::time_point write_by)
      : fd_(fd), read_by_(read_by), write_by_(write_by) {}

  bool is_readable() const override { return pos_ < len_ || wait(POLLIN, read_by_); }
  bool is_writable() const override { return wait(POLLOUT, write_by_); }

  ssize_t read(char* ptr, size_t size) override {
    if (pos_ == len_) {  // httplib reads a request line byte by byte: buffer the socket
      if (!wait(POLLIN, read_by_)) return -1;
      ssize_t n;
      do n = ::recv(fd_, buffer_, sizeof buffer_, 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      pos_ = 0;
      len_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, len_ - pos_);
    std::memcpy(ptr, buffer_ + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!wait(POLLOUT, write_by_)) return -1;
    ssize_t n;
    do n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(::getpeername, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(::getsockname, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  // Waits for `events` until `deadline`; true when the socket is ready (or closed: the
  // next recv/send then says so).
  bool wait(short events, Clock::time_point deadline) const {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd_, events, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 60'000)));
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0 && Clock::now() < deadline) continue;
      return ready > 0;
    }
  }

  void address(int (*get)(int, sockaddr*, socklen_t*), std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    ip.clear();
    port = 0;
    if (get(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return;
    char text[INET6_ADDRSTRLEN] = {};
    if (addr.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
      ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
      port = ntohs(a->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
      ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
      port = ntohs(a->sin6_port);
    }
    ip = text;
  }

  int fd_;
  Clock::time_point read_by_, write_by_;
  char buffer_[4096];
  size_t pos_ = 0, len_ = 0;
};

// httplib's server with the connection handling above, and a stop that does not wait for
// slow clients: it shuts their sockets down, so every worker returns at once.
class GuardedServer final : public httplib::Server {
 public:
  GuardedServer() {
    new_task_queue = [] { return new httplib::ThreadPool(kWorkers); };
    set_payload_max_length(kMaxRequestBody);
  }

  void stop_now() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
    }
    stop();
  }

 private:
  bool process_and_close_socket(socket_t sock) override {
    bool ok = false;
    if (enter(sock)) {
      const Clock::time_point start = Clock::now();
      DeadlineStream stream(sock, start + kReadDeadline, start + kWriteDeadline);
      bool closed = false;
      try {
        ok = process_request(stream, /*close_connection=*/true, closed, nullptr);
      } catch (...) {  // a worker thread must not throw
      }
      std::lock_guard<std::mutex> lock(mutex_);
      open_.erase(sock);
    }
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }

  // Registers a connection so that stop_now() can cut it; false once stopping.
  bool enter(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return false;
    open_.insert(fd);
    return true;
  }

  std::mutex mutex_;
  std::set<int> open_;
  bool stopping_ = false;
};

}  // namespace

struct Dashboard::Server {
  GuardedServer http;
  std::thread thread;
  std::atomic<bool> finished{false};
  std::string chart_js;
};

Dashboard::Dashboard(int port, const std::string& host) : host_(host), server_(std::make_unique<Server>()) {
  if (port < 0 || port > 65535) throw ConfigError(fmt::format("--dashboard: port must be 0..65535, got {}", port));
  Server& s = *server_;
  s.chart_js = embedded_chart_js();
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
  server_->http.stop_now();
  if (server_->thread.joinable()) server_->thread.join();
}

std::string Dashboard::url() const { return fmt::format("http://{}:{}/", host_, port_); }

}  // namespace moe
