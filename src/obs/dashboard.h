// `moe train --dashboard PORT`: an HTTP server on its own threads serving the live
// page, Chart.js, and the run's records as JSON (GET /api/metrics?since=N). Training
// only appends to the MetricsFeed under a mutex, so the server never blocks it.
#pragma once
#include <memory>
#include <string>

#include "obs/feed.h"

namespace moe {

class Dashboard {
 public:
  // Binds host:port (port 0: any free port) and starts serving. Throws moe::Error naming
  // the address when it cannot bind.
  explicit Dashboard(int port, const std::string& host = "127.0.0.1");
  // Stops the server and joins its threads without waiting for slow clients: their
  // connections are cut (each gets one request, read within 2 s, answered within 10 s).
  ~Dashboard();
  Dashboard(const Dashboard&) = delete;
  Dashboard& operator=(const Dashboard&) = delete;

  int port() const { return port_; }
  std::string url() const;
  MetricsFeed& feed() { return feed_; }

 private:
  struct Server;
  MetricsFeed feed_;
  std::string host_;
  int port_ = 0;
  std::unique_ptr<Server> server_;
};

}  // namespace moe
