// The port `moe launch` picks for rank 0's rendezvous is held by the launcher
// (net::reserve_port) until the job ends, so nothing else can take it between the pick and
// rank 0's listen or between two rendezvous rounds; rank 0 can still listen on it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/launch_env.h"
#include "dist/rendezvous.h"
#include "dist/tcp_communicator.h"

namespace moe::dist {
namespace {

// A bind of another program that does not ask for SO_REUSEADDR: 0 or the errno.
int plain_bind_error(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const int error = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 ? 0 : errno;
  close(fd);
  return error;
}

TEST(RendezvousPort, AReservedPortTakesRankZerosListenerAndNothingElse) {
  int port = 0;
  const int reservation = net::reserve_port(&port);
  ASSERT_GT(port, 0);
  EXPECT_EQ(plain_bind_error(port), EADDRINUSE) << "the reservation does not hold the port";
  // Two rendezvous rounds: rank 0 listens, a rank connects and is accepted, rank 0 closes.
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    int bound = 0;
    const int listener = net::listen_on(port, 4, &bound);
    EXPECT_EQ(bound, port);
    const int client = net::connect_to("127.0.0.1", port, 5.0);
    std::string peer;
    const int served = net::accept_one(listener, 5.0, &peer);
    EXPECT_EQ(peer, "127.0.0.1");
    net::close_fd(served);
    net::close_fd(client);
    net::close_fd(listener);
    EXPECT_EQ(plain_bind_error(port), EADDRINUSE) << "between rounds";
  }
  net::close_fd(reservation);
}

// A stand-in for torchrun's agent, whose TCPStore listens on MASTER_PORT while the workers
// run: a listening socket on a port whose successor is free. Returns its fd.
int stand_in_store(int* port) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = net::listen_on(0, 4, port);
    if (*port < 65535 && plain_bind_error(*port + 1) == 0) return fd;
    net::close_fd(fd);
  }
  ADD_FAILURE() << "no free pair of ports";
  return -1;
}

// torchrun's variables for `rank` of 2 on one node.
std::map<std::string, std::string> torchrun_env(int rank, int master_port) {
  const std::string r = std::to_string(rank);
  return {{"RANK", r}, {"LOCAL_RANK", r}, {"GROUP_RANK", "0"}, {"ROLE_RANK", r}, {"ROLE_NAME", "default"},
          {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_WORLD_SIZE", "1"}, {"ROLE_WORLD_SIZE", "2"},
          {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(master_port)},
          {"TORCHELASTIC_RESTART_COUNT", "0"}, {"TORCHELASTIC_MAX_RESTARTS", "0"}, {"TORCHELASTIC_RUN_ID", "none"},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
}

// Under torchrun the ranks meet beside the store instead of failing with "Address already
// in use" on MASTER_PORT, and form a working tcp world.
TEST(RendezvousPort, UnderTorchrunTheRanksMeetBesideTheStore) {
  int port = 0;
  const int store = stand_in_store(&port);
  ASSERT_GE(store, 0);
  // Should rank 0 fail, rank 1 gives up soon instead of after the default 300 s.
  const bool set_here = std::getenv("MOE_RENDEZVOUS_TIMEOUT") == nullptr;
  if (set_here) setenv("MOE_RENDEZVOUS_TIMEOUT", "20", 1);
  std::vector<std::string> errors(2);
  std::vector<double> sums(2, 0.0);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        const LaunchEnv env = parse_launch_env(torchrun_env(rank, port));
        std::unique_ptr<Communicator> world = make_tcp_world(env);
        double value = rank + 1;
        world->all_reduce(&value, 1, DType::f64);
        sums[rank] = value;
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  for (std::thread& t : ranks) t.join();
  net::close_fd(store);
  if (set_here) unsetenv("MOE_RENDEZVOUS_TIMEOUT");
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_EQ(sums[rank], 3.0) << "rank " << rank;
  }
}

// A port rank 0 cannot listen on: one line saying what to set, exit code 2 (ConfigError).
TEST(RendezvousPort, ABusyPortIsAOneLineErrorNamingTheFix) {
  int port = 0;
  const int taken = net::listen_on(0, 4, &port);
  std::map<std::string, std::string> vars = torchrun_env(0, port);
  vars.erase("TORCHELASTIC_RUN_ID");  // moe launch's variables: rank 0 listens on MASTER_PORT itself
  try {
    make_tcp_world(parse_launch_env(vars));
    ADD_FAILURE() << "rank 0 listened on a port another socket listens on";
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(fmt::format("cannot listen on port {}", port)), std::string::npos) << message;
    EXPECT_NE(message.find("set MOE_RENDEZVOUS_PORT"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  net::close_fd(taken);
}

}  // namespace
}  // namespace moe::dist
