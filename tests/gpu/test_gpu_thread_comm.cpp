// The threads communicator (dist/cuda/thread_communicator.h) over 3 ranks on one GPU:
// every collective on device buffers against host arithmetic, reductions of every dtype
// (sums in rank order, max, min), in-place forms, splits, simulated nodes.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/gpu.h"
#include "dist/cuda/thread_communicator.h"
#include "gpu_test_util.h"

namespace moe::dist {
namespace {

// Runs body(rank, communicator) on n threads. The bodies check with EXPECT only (no early
// return), so every rank reaches every collective; a rank that throws is reported.
void on_ranks(int n, int per_node, const std::function<void(int, Communicator&)>& body) {
  std::vector<std::unique_ptr<Communicator>> worlds = make_thread_communicators(n, per_node);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r, *worlds[static_cast<size_t>(r)]);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

template <typename T>
std::vector<T> download(const gpu::DeviceArray<T>& d) {
  std::vector<T> host(d.size());
  d.download(host.data(), host.size());
  return host;
}

TEST(GpuThreadComm, CollectivesMatchTheHost) {
  MOE_REQUIRE_GPU();
  const int n = 3;
  const size_t count = 1000;  // more than one block of the reduction kernel
  auto value = [](int rank, size_t i) { return static_cast<float>(rank + 1) * 0.25f + static_cast<float>(i % 7); };
  on_ranks(n, 0, [&](int rank, Communicator& comm) {
    EXPECT_EQ(comm.size(), n);
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_TRUE(comm.device_memory());
    EXPECT_EQ(comm.ranks_per_node(), 0);
    std::vector<float> mine(count);
    for (size_t i = 0; i < count; ++i) mine[i] = value(rank, i);
    // all_reduce in place: sum, max, min.
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
      gpu::DeviceArray<float> data(count);
      data.upload(mine.data(), count);
      comm.all_reduce(data.data(), count, DType::f32, op);
      const std::vector<float> got = download(data);
      size_t wrong = 0;
      for (size_t i = 0; i < count; ++i) {
        float want = value(0, i);
        for (int q = 1; q < n; ++q)
          want = op == ReduceOp::sum ? want + value(q, i) : op == ReduceOp::max ? std::max(want, value(q, i))
                                                                                 : std::min(want, value(q, i));
        wrong += got[i] != want;
      }
      EXPECT_EQ(wrong, 0u) << "op " << static_cast<int>(op);
    }
    // reduce_scatter in place (recv = send + rank * block), and all_gather in place.
    const size_t block = count / n;
    gpu::DeviceArray<float> data(block * n);
    data.upload(mine.data(), block * n);
    comm.reduce_scatter(data.data(), data.data() + rank * block, block, DType::f32);
    std::vector<float> got = download(data);
    size_t wrong = 0;
    for (size_t i = rank * block; i < (rank + 1) * block; ++i) wrong += got[i] != value(0, i) + value(1, i) + value(2, i);
    EXPECT_EQ(wrong, 0u) << "reduce_scatter";
    comm.all_gather(data.data() + rank * block, data.data(), block, DType::f32);
    got = download(data);
    wrong = 0;
    for (size_t i = 0; i < block * n; ++i) wrong += got[i] != value(0, i) + value(1, i) + value(2, i);
    EXPECT_EQ(wrong, 0u) << "all_gather";
    // all_to_all_v: rank r sends q + r + 1 ints to rank q, each its (r, q, k).
    std::vector<int64_t> send_counts(n), recv_counts(n);
    std::vector<int32_t> send;
    for (int q = 0; q < n; ++q) {
      send_counts[q] = q + rank + 1;
      recv_counts[q] = rank + q + 1;
      for (int k = 0; k < q + rank + 1; ++k) send.push_back(100 * rank + 10 * q + k);
    }
    gpu::DeviceArray<int32_t> send_d(send.size()), recv_d(static_cast<size_t>(3 * rank + 6));
    send_d.upload(send.data(), send.size());
    comm.all_to_all_v(send_d.data(), send_counts, recv_d.data(), recv_counts, DType::i32);
    std::vector<int32_t> want_recv;
    for (int q = 0; q < n; ++q)
      for (int k = 0; k < rank + q + 1; ++k) want_recv.push_back(100 * q + 10 * rank + k);
    EXPECT_EQ(download(recv_d), want_recv);
    // broadcast from rank 2; bf16, f64 and i64 sums.
    gpu::DeviceArray<float> root(4);
    const std::vector<float> from_root = {9, 8, 7, static_cast<float>(rank)};
    root.upload(from_root.data(), 4);
    comm.broadcast(root.data(), 4, DType::f32, 2);
    EXPECT_EQ(download(root), (std::vector<float>{9, 8, 7, 2}));
    const std::vector<__nv_bfloat16> half = {__float2bfloat16(0.5f * static_cast<float>(rank + 1))};
    gpu::DeviceArray<__nv_bfloat16> half_d(1);
    half_d.upload(half.data(), 1);
    comm.all_reduce(half_d.data(), 1, DType::bf16, ReduceOp::sum);
    EXPECT_EQ(__bfloat162float(download(half_d)[0]), 3.0f);
    const std::vector<double> wide = {1e-3 * (rank + 1)};
    gpu::DeviceArray<double> wide_d(1);
    wide_d.upload(wide.data(), 1);
    comm.all_reduce(wide_d.data(), 1, DType::f64, ReduceOp::sum);
    EXPECT_EQ(download(wide_d)[0], (1e-3 + 2e-3) + 3e-3) << "ranks added in order";
    const std::vector<int64_t> big = {(int64_t{1} << 40) + rank};
    gpu::DeviceArray<int64_t> big_d(1);
    big_d.upload(big.data(), 1);
    comm.all_reduce(big_d.data(), 1, DType::i64, ReduceOp::sum);
    EXPECT_EQ(download(big_d)[0], 3 * (int64_t{1} << 40) + 3);
    // split: ranks 0 and 2 (color 0, reversed by key), rank 1 alone.
    std::unique_ptr<Communicator> part = comm.split(rank == 1 ? 1 : 0, -rank);
    EXPECT_EQ(part->size(), rank == 1 ? 1 : 2);
    EXPECT_EQ(part->rank(), rank == 0 ? 1 : 0);
    gpu::DeviceArray<int32_t> one(1);
    const std::vector<int32_t> mine_one = {rank + 1};
    one.upload(mine_one.data(), 1);
    part->all_reduce(one.data(), 1, DType::i32, ReduceOp::sum);
    EXPECT_EQ(download(one)[0], rank == 1 ? 2 : 4);
    comm.barrier();
  });
}

TEST(GpuThreadComm, SimulatedNodesAndBadShapes) {
  MOE_REQUIRE_GPU();
  on_ranks(4, 2, [](int, Communicator& comm) { EXPECT_EQ(comm.ranks_per_node(), 2); });
  EXPECT_THROW(make_thread_communicators(4, 3), Error);
  EXPECT_THROW(make_thread_communicators(0), Error);
}

}  // namespace
}  // namespace moe::dist
