#include "dist/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace moe::dist {
namespace net {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

in_addr resolve_ipv4(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int status = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (status != 0 || result == nullptr) MOE_THROW("cannot resolve host '{}': {}", host, gai_strerror(status));
  const in_addr address = reinterpret_cast<sockaddr_in*>(result->ai_addr)->sin_addr;
  freeaddrinfo(result);
  return address;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// A TCP socket with SO_REUSEADDR bound to `port` (0: a free one) on every IPv4 address;
// sets *bound_port. `what` names the purpose in the error.
int bind_reusable(int port, const char* what, int* bound_port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) MOE_THROW("socket(): {}", std::strerror(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    const int error = errno;
    close(fd);
    MOE_THROW("cannot {} port {}: {}", what, port, std::strerror(error));
  }
  socklen_t length = sizeof address;
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  if (bound_port) *bound_port = ntohs(address.sin_port);
  return fd;
}

}  // namespace

int listen_on(int port, int backlog, int* bound_port) {
  const int fd = bind_reusable(port, "listen on", bound_port);
  if (listen(fd, backlog) != 0) {
    const int error = errno;
    close(fd);
    MOE_THROW("listen() on port {}: {}", port, std::strerror(error));
  }
  return fd;
}

int reserve_port(int* port) {
  // The same address as listen_on binds (a conflict is only checked between equal ones),
  // and no listen(): rank 0's listener may then bind it too.
  return bind_reusable(0, "reserve a", port);
}

int connect_to(const std::string& host, int port, double timeout_s) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr = resolve_ipv4(host);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const auto start = Clock::now();
  while (true) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) MOE_THROW("socket(): {}", std::strerror(errno));
    if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
      set_nodelay(fd);
      return fd;
    }
    const int error = errno;
    close(fd);
    // The listener may not be up yet: retry refusals until the deadline.
    if ((error != ECONNREFUSED && error != ETIMEDOUT && error != EAGAIN && error != ECONNRESET) ||
        seconds_since(start) > timeout_s)
      MOE_THROW("cannot connect to {}:{} within {:.0f} s: {}", host, port, timeout_s, std::strerror(error));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int accept_one(int listen_fd, double timeout_s, std::string* peer_host) {
  pollfd waiting{listen_fd, POLLIN, 0};
  const int ready = poll(&waiting, 1, static_cast<int>(timeout_s * 1000));
  if (ready == 0) MOE_THROW("no connection within {:.0f} s", timeout_s);
  if (ready < 0) MOE_THROW("poll(): {}", std::strerror(errno));
  sockaddr_in address{};
  socklen_t length = sizeof address;
  const int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&address), &length, SOCK_CLOEXEC);
  if (fd < 0) MOE_THROW("accept(): {}", std::strerror(errno));
  set_nodelay(fd);
  if (peer_host) {
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &address.sin_addr, text, sizeof text);
    *peer_host = text;
  }
  return fd;
}

void send_all(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) MOE_THROW("send(): {}", n < 0 ? std::strerror(errno) : "connection closed");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void recv_all(int fd, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) MOE_THROW("recv(): {}", std::strerror(errno));
    if (n == 0) MOE_THROW("connection closed by the peer");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void send_string(int fd, const std::string& text) {
  const uint64_t length = text.size();
  send_all(fd, &length, sizeof length);
  send_all(fd, text.data(), text.size());
}

std::string recv_string(int fd, size_t max_bytes) {
  uint64_t length = 0;
  recv_all(fd, &length, sizeof length);
  if (length > max_bytes) MOE_THROW("peer announced a {}-byte message (at most {} expected)", length, max_bytes);
  std::string text(length, '\0');
  recv_all(fd, text.data(), length);
  return text;
}

void close_fd(int fd) {
  if (fd >= 0) close(fd);
}

}  // namespace net

namespace {

constexpr uint64_t kMagic = 0x6d6f652d72647a31ull;  // "moe-rdz1"
constexpr size_t kMaxPayload = 1 << 20;

double default_timeout() {
  if (const char* text = std::getenv("MOE_RENDEZVOUS_TIMEOUT")) {
    const double value = std::atof(text);
    if (value > 0) return value;
  }
  return 300.0;
}

// RAII for the fds of one round.
struct FdGuard {
  std::vector<int> fds;
  ~FdGuard() {
    for (int fd : fds) net::close_fd(fd);
  }
};

}  // namespace

std::vector<RendezvousEntry> rendezvous_all_gather(const std::string& master_addr, int master_port, int rank,
                                                   int world_size, const std::string& tag,
                                                   const std::string& payload, double timeout_s) {
  if (timeout_s <= 0) timeout_s = default_timeout();
  MOE_CHECK(rank >= 0 && rank < world_size, "rendezvous rank {} outside world size {}", rank, world_size);
  MOE_CHECK(payload.size() <= kMaxPayload, "rendezvous payload of {} bytes is too large", payload.size());
  std::vector<RendezvousEntry> entries(static_cast<size_t>(world_size));
  if (world_size == 1) {
    entries[0] = {master_addr.empty() ? "127.0.0.1" : master_addr, payload};
    return entries;
  }
  if (master_addr.empty() || master_port <= 0)
    MOE_CONFIG_ERROR("rendezvous of {} ranks needs MASTER_ADDR and MASTER_PORT (moe launch sets them)", world_size);
  FdGuard guard;
  if (rank == 0) {
    int listener = -1;
    try {
      listener = net::listen_on(master_port, world_size, nullptr);
    } catch (const Error& e) {
      MOE_CONFIG_ERROR("rendezvous '{}': rank 0 {}; set MOE_RENDEZVOUS_PORT to a free port of MASTER_ADDR for every "
                       "rank (the default is MASTER_PORT, or MASTER_PORT + 1 under torchrun)",
                       tag, e.what());
    }
    guard.fds.push_back(listener);
    entries[0] = {master_addr, payload};
    std::vector<int> peer_fd(static_cast<size_t>(world_size), -1);
    const auto start = std::chrono::steady_clock::now();
    for (int joined = 1; joined < world_size; ++joined) {
      const double left =
          timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (left <= 0)
        MOE_THROW("rendezvous '{}' on port {}: only {} of {} ranks arrived within {:.0f} s", tag, master_port, joined,
                  world_size, timeout_s);
      std::string host;
      const int fd = net::accept_one(listener, left, &host);
      guard.fds.push_back(fd);
      const char welcome = 1;
      net::send_all(fd, &welcome, 1);
      uint64_t magic = 0;
      int32_t peer_rank = -1;
      net::recv_all(fd, &magic, sizeof magic);
      MOE_CHECK(magic == kMagic, "rendezvous on port {}: a connection from {} is not a moe rank", master_port, host);
      const std::string peer_tag = net::recv_string(fd, 256);
      net::recv_all(fd, &peer_rank, sizeof peer_rank);
      MOE_CHECK(peer_tag == tag, "rendezvous: rank {} is in round '{}' but rank 0 in '{}'", peer_rank, peer_tag, tag);
      MOE_CHECK(peer_rank > 0 && peer_rank < world_size && peer_fd[peer_rank] < 0,
                "rendezvous '{}': rank {} from {} is out of range or arrived twice", tag, peer_rank, host);
      peer_fd[peer_rank] = fd;
      entries[peer_rank] = {host, net::recv_string(fd, kMaxPayload)};
    }
    for (int r = 1; r < world_size; ++r)
      for (const RendezvousEntry& entry : entries) {
        net::send_string(peer_fd[r], entry.host);
        net::send_string(peer_fd[r], entry.payload);
      }
    // Wait for every rank's acknowledgement so that the listener closes only after all
    // have their answer (a later round may reuse the port).
    for (int r = 1; r < world_size; ++r) {
      char ack = 0;
      net::recv_all(peer_fd[r], &ack, 1);
    }
    return entries;
  }
  // Rank 0 greets each connection it serves in this round. A connection that lands in
  // the backlog of the previous round's listener is closed without a greeting: retry.
  const auto start = std::chrono::steady_clock::now();
  int fd = -1;
  while (fd < 0) {
    const double left = timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (left <= 0) MOE_THROW("rendezvous '{}' at {}:{}: rank 0 did not answer within {:.0f} s", tag, master_addr,
                             master_port, timeout_s);
    const int candidate = net::connect_to(master_addr, master_port, left);
    pollfd greeting{candidate, POLLIN, 0};
    char welcome = 0;
    if (poll(&greeting, 1, static_cast<int>(left * 1000)) == 1 && recv(candidate, &welcome, 1, 0) == 1) {
      fd = candidate;
    } else {
      net::close_fd(candidate);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  guard.fds.push_back(fd);
  const int32_t my_rank = rank;
  net::send_all(fd, &kMagic, sizeof kMagic);
  net::send_string(fd, tag);
  net::send_all(fd, &my_rank, sizeof my_rank);
  net::send_string(fd, payload);
  pollfd waiting{fd, POLLIN, 0};
  if (poll(&waiting, 1, static_cast<int>(timeout_s * 1000)) == 0)
    MOE_THROW("rendezvous '{}' at {}:{}: no answer from rank 0 within {:.0f} s", tag, master_addr, master_port,
              timeout_s);
  for (RendezvousEntry& entry : entries) {
    entry.host = net::recv_string(fd, 256);
    entry.payload = net::recv_string(fd, kMaxPayload);
  }
  const char ack = 1;
  net::send_all(fd, &ack, 1);
  return entries;
}

}  // namespace moe::dist
