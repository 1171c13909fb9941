// The port `moe launch` picks for rank 0's rendezvous is held by the launcher
// (net::reserve_port) until the job ends, so nothing else can take it between the pick and
// rank 0's listen or between two rendezvous rounds; rank 0 can still listen on it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <gtest/gtest.h>

#include "dist/rendezvous.h"

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

}  // namespace
}  // namespace moe::dist
