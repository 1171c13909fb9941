// The single-process backend, the backend factory, and the tcp backend with its ranks as
// threads of this process (the multi-process runs are the mpi-labelled tests).
#include <gtest/gtest.h>

#include <functional>
#include <latch>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/hierarchical_all_to_all.h"
#include "dist/launch_env.h"
#include "dist/process_groups.h"
#include "dist/rendezvous.h"
#include "dist/single_communicator.h"
#include "dist/tcp_communicator.h"
#include "tcp_ranks.h"

namespace moe::dist {
namespace {

TEST(SingleCommunicator, CollectivesAreCopies) {
  auto comm = make_single_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->backend(), "single");
  std::vector<float> data = {1, -2, 3};
  comm->all_reduce(data.data(), 3, DType::f32);
  EXPECT_EQ(data, (std::vector<float>{1, -2, 3}));
  std::vector<float> out(3, 0);
  comm->reduce_scatter(data.data(), out.data(), 3, DType::f32);
  EXPECT_EQ(out, data);
  std::fill(out.begin(), out.end(), 0.0f);
  comm->all_gather(data.data(), out.data(), 3, DType::f32);
  EXPECT_EQ(out, data);
  std::fill(out.begin(), out.end(), 0.0f);
  comm->all_to_all_v(data.data(), {3}, out.data(), {3}, DType::f32);
  EXPECT_EQ(out, data);
  EXPECT_THROW(comm->all_to_all_v(data.data(), {3}, out.data(), {2}, DType::f32), Error);
  EXPECT_THROW(comm->all_to_all_v(data.data(), {3, 0}, out.data(), {3, 0}, DType::f32), Error);
  EXPECT_THROW(comm->broadcast(data.data(), 3, DType::f32, 1), Error);
  auto work = comm->all_reduce_async(data.data(), 3, DType::f32, ReduceOp::max);
  EXPECT_TRUE(work->done());
  EXPECT_NE(comm->split(0, 0), nullptr);
  EXPECT_EQ(comm->split(-1, 0), nullptr);
}

TEST(SingleCommunicator, ProcessGroupsAndAllToAllOfAWorldOfOne) {
  ProcessGroups groups = make_process_groups(make_single_communicator(), 1);
  EXPECT_EQ(groups.world->size(), 1);
  EXPECT_EQ(groups.expert_parallel->size(), 1);
  EXPECT_EQ(groups.n_nodes, 1);
  for (const AllToAllKind kind : {AllToAllKind::Flat, AllToAllKind::Hierarchical}) {
    auto exchange = make_all_to_all(kind, *groups.expert_parallel, groups);
    std::vector<int64_t> send = {4, 5}, recv(2);
    exchange->exchange(send.data(), {2}, recv.data(), {2}, DType::i64);
    EXPECT_EQ(recv, send) << name_of(kind);
  }
  EXPECT_THROW(make_process_groups(make_single_communicator(), 2), ConfigError);
}

TEST(WorldCommunicator, FactoryBuildsTheBackendItIsAskedFor) {
  // ctest runs this without any launcher variables: a world of one.
  EXPECT_EQ(make_world_communicator(CommBackend::Single)->size(), 1);
#ifndef MOE_HAVE_CUDA
  EXPECT_THROW(make_world_communicator(CommBackend::Nccl), ConfigError);
#endif
}

TEST(TcpCommunicator, ThreeRanksInOneProcess) {
  run_tcp_ranks(3, [](std::unique_ptr<Communicator>& world, int rank) {
    Communicator& comm = *world;
    EXPECT_EQ(comm.backend(), "tcp");
    EXPECT_EQ(comm.rank(), rank);
    // Large enough to fill socket buffers in both directions at once.
    const size_t count = 1 << 20;
    std::vector<float> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = static_cast<float>((i + rank) % 17);
    comm.all_reduce(data.data(), count, DType::f32);
    for (size_t i = 0; i < count; i += 4099)
      ASSERT_EQ(data[i], static_cast<float>(i % 17 + (i + 1) % 17 + (i + 2) % 17)) << i;
    // Rank r sends r + p + 1 int64s to peer p.
    std::vector<int64_t> send_counts(3), recv_counts(3), send, expected;
    for (int p = 0; p < 3; ++p) {
      send_counts[p] = rank + p + 1;
      recv_counts[p] = p + rank + 1;
      for (int64_t i = 0; i < send_counts[p]; ++i) send.push_back(rank * 100 + p * 10 + i);
      for (int64_t i = 0; i < recv_counts[p]; ++i) expected.push_back(p * 100 + rank * 10 + i);
    }
    std::vector<int64_t> recv(expected.size());
    comm.all_to_all_v_async(send.data(), send_counts, recv.data(), recv_counts, DType::i64)->wait();
    EXPECT_EQ(recv, expected);
    // Counts that disagree between sender and receiver: an error on the receiver, not a hang.
    std::vector<int64_t> wrong = recv_counts;
    if (rank == 0) wrong[1] += 1;
    std::vector<int64_t> sink(expected.size() + 1);
    if (rank == 0) {
      EXPECT_THROW(comm.all_to_all_v(send.data(), send_counts, sink.data(), wrong, DType::i64), Error);
    } else {
      // Rank 0 stops mid-exchange: the others finish or see its connection close.
      try {
        comm.all_to_all_v(send.data(), send_counts, sink.data(), recv_counts, DType::i64);
      } catch (const Error&) {
      }
    }
  });
}

TEST(TcpCommunicator, ARankLeavingWithAnOperationInFlightDoesNotHang) {
  std::latch rank0_left(1);
  run_tcp_ranks(2, [&](std::unique_ptr<Communicator>& world, int rank) {
    if (rank == 0) {
      // Rank 1 joins this all-reduce only after rank 0 has left: destroying the world
      // must end the operation instead of waiting for rank 1.
      std::vector<float> data(8, 1.0f);
      auto pending = world->all_reduce_async(data.data(), data.size(), DType::f32, ReduceOp::sum);
      world.reset();
      rank0_left.count_down();
      EXPECT_TRUE(pending->done());
      EXPECT_THROW(pending->wait(), Error);
    } else {
      rank0_left.wait();
      std::vector<float> data(8, 1.0f);
      EXPECT_THROW(world->all_reduce(data.data(), data.size(), DType::f32), Error);
    }
  });
}

// Two ranks that issue collectives on two communicators in different orders: their
// 0-byte barriers look alike on the wire, so without the operations' tags each would
// silently take the other's for its own and every later message would be misread. With
// them it is an error on both ranks naming the operations.
TEST(TcpCommunicator, CollectivesInDifferentOrdersAreAnErrorNamingBoth) {
  run_tcp_ranks(2, [](std::unique_ptr<Communicator>& world, int rank) {
    std::unique_ptr<Communicator> sub = world->split(0, rank);
    std::vector<float> ok(4, 1.0f);
    sub->all_reduce(ok.data(), ok.size(), DType::f32);  // in the same order: fine
    EXPECT_EQ(ok[0], 2.0f);
    try {
      if (rank == 0) {
        world->barrier();
        sub->barrier();
      } else {
        sub->barrier();
        world->barrier();
      }
      ADD_FAILURE() << "rank " << rank << ": barriers in different orders went through";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("issued their collectives in different orders"), std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
}  // namespace moe::dist
