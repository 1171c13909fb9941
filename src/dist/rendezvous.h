// A small TCP rendezvous (POSIX sockets): rank 0 listens on a port of MASTER_ADDR
// (LaunchEnv::rendezvous_port: MASTER_PORT under `moe launch`, MASTER_PORT + 1 under
// torchrun, whose own store holds MASTER_PORT; MOE_RENDEZVOUS_PORT overrides), every rank
// sends it a payload, and every rank gets all payloads back. Workers use it to exchange
// the NCCL unique id and the addresses of the tcp backend's mesh.
#pragma once
#include <string>
#include <vector>

namespace moe::dist {

struct RendezvousEntry {
  std::string host;     // address of the rank as rank 0 saw it (rank 0: master_addr)
  std::string payload;  // what the rank sent (binary-safe)
};

// Collective over world_size processes. tag names the round (all ranks must agree; a
// different tag is an error, not a hang). Throws after timeout_s without all ranks; a
// port rank 0 cannot listen on is a ConfigError (one line: what to set).
// MOE_RENDEZVOUS_TIMEOUT (seconds) overrides the default timeout.
std::vector<RendezvousEntry> rendezvous_all_gather(const std::string& master_addr, int master_port, int rank,
                                                   int world_size, const std::string& tag,
                                                   const std::string& payload, double timeout_s = 0);

// Socket helpers shared with the tcp backend. All throw moe::Error with the reason.
namespace net {
// Listening IPv4 socket on port (0: any free port); returns the fd and sets *bound_port.
int listen_on(int port, int backlog, int* bound_port);
// Holds a free port for a rendezvous that another process will listen on: a socket bound
// to it with SO_REUSEADDR and not listening. While it is open, listen_on(port) still
// succeeds (it sets SO_REUSEADDR too), but the kernel gives the port to no other bind()
// and to no outgoing connection as its local port. Returns the fd; sets *port.
int reserve_port(int* port);
// Connects to host:port, retrying refused connections until timeout_s.
int connect_to(const std::string& host, int port, double timeout_s);
// Accepts one connection within timeout_s; *peer_host gets the peer's address.
int accept_one(int listen_fd, double timeout_s, std::string* peer_host);
void send_all(int fd, const void* data, size_t bytes);
void recv_all(int fd, void* data, size_t bytes);
void send_string(int fd, const std::string& text);
std::string recv_string(int fd, size_t max_bytes);
void close_fd(int fd);
}  // namespace net

}  // namespace moe::dist
