// Code that runs collectives on a device-memory backend (nccl) must hand it only buffers
// of that backend's memory kind: host values go through allocate() and copy(). Without a
// GPU this is checked with a wrapper around tcp ranks (threads of this process) that
// claims device memory and refuses any buffer that allocate() did not hand out. (The
// hierarchical all-to-all once all-gathered a host int through nccl: an illegal address
// on the GPU, found only on a multi-GPU machine.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "core/error.h"
#include "dist/all_to_all_bench.h"
#include "dist/comm_util.h"
#include "dist/hierarchical_all_to_all.h"
#include "tcp_ranks.h"
#include "config/run_config.h"

namespace moe::dist {
namespace {

// The allocations of one wrapped world (its splits share them).
struct Allocations {
  std::mutex mutex;
  std::map<const char*, size_t> blocks;  // start -> bytes
  bool holds(const void* p, size_t bytes) {
    std::lock_guard lock(mutex);
    const char* c = static_cast<const char*>(p);
    auto it = blocks.upper_bound(c);
    if (it == blocks.begin()) return false;
    --it;
    return c >= it->first && c + bytes <= it->first + it->second;
  }
};

class DeviceMemoryCheck final : public Communicator {
 public:
  DeviceMemoryCheck(std::unique_ptr<Communicator> inner, std::shared_ptr<Allocations> allocations)
      : inner_(std::move(inner)), allocations_(std::move(allocations)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return "device-check"; }
  bool device_memory() const override { return true; }
  std::shared_ptr<void> allocate(size_t bytes) override {
    char* p = new char[std::max<size_t>(bytes, 1)];
    {
      std::lock_guard lock(allocations_->mutex);
      allocations_->blocks[p] = std::max<size_t>(bytes, 1);
    }
    std::shared_ptr<Allocations> allocations = allocations_;
    return std::shared_ptr<void>(p, [allocations](void* q) {
      std::lock_guard lock(allocations->mutex);
      allocations->blocks.erase(static_cast<char*>(q));
      delete[] static_cast<char*>(q);
    });
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }

  std::unique_ptr<Work> all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op) override {
    check(data, count, dtype, "all_reduce");
    return inner_->all_reduce_async(data, count, dtype, op);
  }
  std::unique_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DType dtype,
                                             ReduceOp op) override {
    check(send, recv_count * static_cast<size_t>(size()), dtype, "reduce_scatter send");
    check(recv, recv_count, dtype, "reduce_scatter recv");
    return inner_->reduce_scatter_async(send, recv, recv_count, dtype, op);
  }
  std::unique_ptr<Work> all_gather_async(const void* send, void* recv, size_t send_count, DType dtype) override {
    check(send, send_count, dtype, "all_gather send");
    check(recv, send_count * static_cast<size_t>(size()), dtype, "all_gather recv");
    return inner_->all_gather_async(send, recv, send_count, dtype);
  }
  std::unique_ptr<Work> all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                           const std::vector<int64_t>& recv_counts, DType dtype) override {
    check(send, static_cast<size_t>(checked_count_sum(send_counts, size(), "send_counts")), dtype, "all_to_all send");
    check(recv, static_cast<size_t>(checked_count_sum(recv_counts, size(), "recv_counts")), dtype, "all_to_all recv");
    return inner_->all_to_all_v_async(send, send_counts, recv, recv_counts, dtype);
  }
  std::unique_ptr<Work> broadcast_async(void* data, size_t count, DType dtype, int root) override {
    check(data, count, dtype, "broadcast");
    return inner_->broadcast_async(data, count, dtype, root);
  }
  void barrier() override { inner_->barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    std::unique_ptr<Communicator> sub = inner_->split(color, key);
    if (!sub) return nullptr;
    return std::make_unique<DeviceMemoryCheck>(std::move(sub), allocations_);
  }

 private:
  void check(const void* p, size_t count, DType dtype, const char* what) const {
    if (count == 0) return;
    MOE_CHECK(allocations_->holds(p, count * dtype_bytes(dtype)),
              "{}: {} elements at {} are not in memory this backend allocated (a host buffer?)", what, count, p);
  }
  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<Allocations> allocations_;
};

std::unique_ptr<Communicator> checked(std::unique_ptr<Communicator> world) {
  return std::make_unique<DeviceMemoryCheck>(std::move(world), std::make_shared<Allocations>());
}

TEST(DeviceMemoryCheck, RefusesHostBuffers) {
  run_tcp_ranks(2, [](std::unique_ptr<Communicator>& tcp, int) {
    auto comm = checked(std::move(tcp));
    int64_t host = 1;
    EXPECT_THROW(comm->all_reduce(&host, 1, DType::i64), Error);
    std::shared_ptr<void> device = comm->allocate(sizeof host);
    comm->copy(device.get(), &host, sizeof host);
    comm->all_reduce(device.get(), 1, DType::i64);
    comm->copy(&host, device.get(), sizeof host);
    EXPECT_EQ(host, 2);
    // The host-value helpers stage through allocate().
    all_reduce_host(*comm, &host, 1, DType::i64, ReduceOp::sum);
    EXPECT_EQ(host, 4);
    int32_t mine = comm->rank(), all[2] = {-1, -1};
    all_gather_host(*comm, &mine, all, 1, DType::i32);
    EXPECT_EQ(all[0], 0);
    EXPECT_EQ(all[1], 1);
  });
}

// 4 ranks as 2 nodes of 2: the hierarchical exchange (its sub-groups, the count exchange,
// the packing) touches only allocated buffers and gives the flat exchange's result.
TEST(DeviceMemoryCheck, HierarchicalAllToAllUsesOnlyBackendMemory) {
  run_tcp_ranks(4, [](std::unique_ptr<Communicator>& tcp, int rank) {
    auto comm = checked(std::move(tcp));
    const int P = 4;
    std::vector<int64_t> send_counts(P), recv_counts(P);
    std::vector<int32_t> send, expected;
    for (int p = 0; p < P; ++p) {
      send_counts[p] = 1 + (rank + 2 * p) % 3;  // rank r sends 1 + (r + 2p) % 3 values to p
      recv_counts[p] = 1 + (p + 2 * rank) % 3;
      for (int64_t i = 0; i < send_counts[p]; ++i) send.push_back(rank * 1000 + p * 10 + static_cast<int32_t>(i));
      for (int64_t i = 0; i < recv_counts[p]; ++i) expected.push_back(p * 1000 + rank * 10 + static_cast<int32_t>(i));
    }
    std::shared_ptr<void> send_d = comm->allocate(send.size() * 4), recv_d = comm->allocate(expected.size() * 4);
    comm->copy(send_d.get(), send.data(), send.size() * 4);
    for (const AllToAllKind kind : {AllToAllKind::Flat, AllToAllKind::Hierarchical}) {
      std::unique_ptr<AllToAll> a2a = make_all_to_all(kind, *comm, /*node=*/rank / 2);
      std::memset(recv_d.get(), 0, expected.size() * 4);
      a2a->exchange(send_d.get(), send_counts, recv_d.get(), recv_counts, DType::i32);
      std::vector<int32_t> got(expected.size());
      comm->copy(got.data(), recv_d.get(), got.size() * 4);
      EXPECT_EQ(got, expected) << name_of(kind);
    }
  });
}

// The all-to-all bench over such a backend: it checks every row it receives.
TEST(DeviceMemoryCheck, AllToAllBenchUsesOnlyBackendMemory) {
  run_tcp_ranks(2, [](std::unique_ptr<Communicator>& tcp, int) {
    auto comm = checked(std::move(tcp));
    RunConfig config;
    config.model.dim = 16;
    config.model.seq_len = 8;
    config.model.moe.top_k = 2;
    config.training.micro_batch = 2;
    config.parallel.expert_parallel = 2;
    std::ostringstream out;
    const auto results = run_all_to_all_bench(config, *comm, 1, 2, out);
    ASSERT_EQ(results.size(), 2u);
    for (const auto& r : results) EXPECT_TRUE(r.rows_ok) << name_of(r.kind);
  });
}

}  // namespace
}  // namespace moe::dist
