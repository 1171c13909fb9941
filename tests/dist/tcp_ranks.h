// Ranks as threads of one test process, each with its own tcp world (CPU tests of
// multi-rank code without mpirun).
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dist/communicator.h"
#include "dist/launch_env.h"
#include "dist/rendezvous.h"
#include "dist/tcp_communicator.h"

namespace moe::dist {

// Runs body(rank) on world_size threads, each with its own tcp world through a
// rendezvous on a free local port.
inline void run_tcp_ranks(int world_size, const std::function<void(std::unique_ptr<Communicator>&, int)>& body) {
  int port = 0;
  net::close_fd(net::listen_on(0, 1, &port));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world_size);
  for (int rank = 0; rank < world_size; ++rank)
    threads.emplace_back([&, rank] {
      try {
        LaunchEnv env;
        env.rank = rank;
        env.world_size = world_size;
        env.local_size = world_size;
        env.local_rank = rank;
        env.master_addr = "127.0.0.1";
        env.master_port = port;
        env.rendezvous_port = port;
        env.source = "torchrun";
        std::unique_ptr<Communicator> world = make_tcp_world(env);
        body(world, rank);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < world_size; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

}  // namespace moe::dist
