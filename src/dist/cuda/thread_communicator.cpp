#include "dist/cuda/thread_communicator.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <numeric>
#include <utility>

#include "core/error.h"
#include "core/gpu.h"
#include "dist/cuda/thread_reduce.h"

namespace moe::dist {
namespace {

constexpr int kMaxRanks = kMaxThreadRanks;

// What every rank posts for a collective.
struct Posted {
  const void* send = nullptr;
  void* recv = nullptr;
  std::vector<int64_t> send_counts, recv_counts;
  int color = 0, key = 0;
};

// A barrier that gives up: a rank that failed (threw) never arrives, and the others
// should fail too rather than wait forever.
class TimedBarrier {
 public:
  explicit TimedBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      all_.notify_all();
      return;
    }
    MOE_CHECK(all_.wait_for(lock, std::chrono::seconds(120), [&] { return generation_ != generation; }),
              "threads communicator: waited 120 s for the other ranks (did one fail?)");
  }

 private:
  std::mutex mutex_;
  std::condition_variable all_;
  int n_, arrived_ = 0;
  int64_t generation_ = 0;
};

struct GroupState {
  explicit GroupState(int n) : size(n), sync(n), posted(static_cast<size_t>(n)) {}
  int size;
  TimedBarrier sync;
  std::vector<Posted> posted;
  std::mutex mutex;
  int64_t splits = 0;  // split() calls so far (each rank counts its own; all agree)
  std::map<std::pair<int64_t, int>, std::shared_ptr<GroupState>> children;  // (split, color)
};

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool done() override { return true; }
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<GroupState> state, int rank, int ranks_per_node = 0)
      : state_(std::move(state)), rank_(rank), ranks_per_node_(ranks_per_node) {
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&work_, cudaStreamNonBlocking));
  }
  ~ThreadCommunicator() override { cudaStreamDestroy(work_); }
  int rank() const override { return rank_; }
  int size() const override { return state_->size; }
  std::string backend() const override { return "threads"; }
  void set_stream(void* stream) override { caller_ = static_cast<cudaStream_t>(stream); }
  bool device_memory() const override { return true; }
  int ranks_per_node() const override { return ranks_per_node_; }
  std::shared_ptr<void> allocate(size_t bytes) override {
    void* p = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 1));
    return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, caller_));
  }
  void synchronize() override { MOE_CUDA_CHECK(cudaStreamSynchronize(caller_)); }

  std::unique_ptr<Work> all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op) override {
    reduce_into(count, dtype, op, [](int) { return int64_t{0}; }, data);
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DType dtype,
                                             ReduceOp op) override {
    reduce_into(recv_count, dtype, op, [&](int) { return static_cast<int64_t>(rank_) * static_cast<int64_t>(recv_count); },
                recv, send);
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> all_gather_async(const void* send, void* recv, size_t send_count, DType dtype) override {
    const size_t bytes = send_count * dtype_bytes(dtype);
    exchange(send, recv, [&](const Posted& from, int q) {
      copy_on_work(static_cast<char*>(recv) + static_cast<size_t>(q) * bytes, from.send, bytes);
    });
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                           const std::vector<int64_t>& recv_counts, DType dtype) override {
    MOE_CHECK(static_cast<int>(send_counts.size()) == size() && static_cast<int>(recv_counts.size()) == size(),
              "threads all_to_all_v: {} / {} counts for {} ranks", send_counts.size(), recv_counts.size(), size());
    const size_t elem = dtype_bytes(dtype);
    Posted mine;
    mine.send = send;
    mine.recv = recv;
    mine.send_counts = send_counts;
    mine.recv_counts = recv_counts;
    run(mine, [&] {
      int64_t at = 0;  // where source q's block lands here
      for (int q = 0; q < size(); ++q) {
        const Posted& from = state_->posted[static_cast<size_t>(q)];
        MOE_CHECK(from.send_counts[static_cast<size_t>(rank_)] == recv_counts[static_cast<size_t>(q)],
                  "threads all_to_all_v: rank {} sends {} to rank {}, which expects {}", q,
                  from.send_counts[static_cast<size_t>(rank_)], rank_, recv_counts[static_cast<size_t>(q)]);
        const int64_t skip = std::accumulate(from.send_counts.begin(), from.send_counts.begin() + rank_, int64_t{0});
        copy_on_work(static_cast<char*>(recv) + static_cast<size_t>(at) * elem,
                     static_cast<const char*>(from.send) + static_cast<size_t>(skip) * elem,
                     static_cast<size_t>(recv_counts[static_cast<size_t>(q)]) * elem);
        at += recv_counts[static_cast<size_t>(q)];
      }
    });
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> broadcast_async(void* data, size_t count, DType dtype, int root) override {
    MOE_CHECK(root >= 0 && root < size(), "threads broadcast: root {} of {} ranks", root, size());
    Posted mine;
    mine.recv = data;
    run(mine, [&] {
      if (rank_ != root)
        copy_on_work(data, state_->posted[static_cast<size_t>(root)].recv, count * dtype_bytes(dtype));
    });
    return std::make_unique<DoneWork>();
  }
  void barrier() override { state_->sync.arrive_and_wait(); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    Posted mine;
    mine.color = color;
    mine.key = key;
    std::shared_ptr<GroupState> child;
    int child_rank = 0;
    const int64_t generation = splits_++;
    run(mine, [&] {
      std::vector<std::pair<int, int>> members;  // (key, rank) of this color
      for (int q = 0; q < size(); ++q)
        if (state_->posted[static_cast<size_t>(q)].color == color)
          members.emplace_back(state_->posted[static_cast<size_t>(q)].key, q);
      std::sort(members.begin(), members.end());
      child_rank = static_cast<int>(std::find(members.begin(), members.end(), std::make_pair(key, rank_)) - members.begin());
      std::lock_guard<std::mutex> lock(state_->mutex);
      auto& slot = state_->children[{generation, color}];
      if (!slot) slot = std::make_shared<GroupState>(static_cast<int>(members.size()));
      child = slot;
    });
    return std::make_unique<ThreadCommunicator>(child, child_rank);
  }
  std::unique_ptr<Work> group_end() override { return std::make_unique<DoneWork>(); }

 private:
  // Posts this rank's part, waits for all, runs `body` (reads the others' posts, writes this
  // rank's outputs on the work stream), waits for it and for every rank to finish.
  template <typename Body>
  void run(const Posted& mine, Body body) {
    MOE_CUDA_CHECK(cudaStreamSynchronize(caller_));  // the inputs are written
    state_->posted[static_cast<size_t>(rank_)] = mine;
    state_->sync.arrive_and_wait();
    body();
    MOE_CUDA_CHECK(cudaStreamSynchronize(work_));
    state_->sync.arrive_and_wait();  // nobody reads what is about to change
  }
  template <typename Each>
  void exchange(const void* send, void* recv, Each each) {
    Posted mine;
    mine.send = send;
    mine.recv = recv;
    run(mine, [&] {
      for (int q = 0; q < size(); ++q) each(state_->posted[static_cast<size_t>(q)], q);
    });
  }
  void copy_on_work(void* dst, const void* src, size_t bytes) {
    if (bytes > 0 && dst != src) MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, work_));
  }
  // out[0, count) = op over the ranks of their send (or out, for in-place sums) from the
  // element offset_of(q); computed into a scratch first, written once every rank has read.
  template <typename OffsetOf>
  void reduce_into(size_t count, DType dtype, ReduceOp op, OffsetOf offset_of, void* out, const void* send = nullptr) {
    MOE_CHECK(size() <= kMaxRanks, "threads communicator: at most {} ranks", kMaxRanks);
    const size_t bytes = count * dtype_bytes(dtype);
    // Grows only: a cudaFree per collective would wait for every thread's work on the GPU.
    if (scratch_bytes_ < bytes) {
      scratch_ = allocate(bytes);
      scratch_bytes_ = bytes;
    }
    const std::shared_ptr<void>& scratch = scratch_;
    Posted mine;
    mine.send = send ? send : out;
    MOE_CUDA_CHECK(cudaStreamSynchronize(caller_));
    state_->posted[static_cast<size_t>(rank_)] = mine;
    state_->sync.arrive_and_wait();
    RankPointers in{};
    for (int q = 0; q < size(); ++q) in.p[q] = state_->posted[static_cast<size_t>(q)].send;
    const int code = op == ReduceOp::sum ? 0 : op == ReduceOp::max ? 1 : 2;
    MOE_CHECK(dtype != DType::u8, "threads communicator: no reductions of bytes");
    const ReduceKind kind = dtype == DType::f32    ? ReduceKind::f32
                            : dtype == DType::f64  ? ReduceKind::f64
                            : dtype == DType::bf16 ? ReduceKind::bf16
                            : dtype == DType::i32  ? ReduceKind::i32
                                                   : ReduceKind::i64;
    MOE_CHECK(reduce_ranks(scratch.get(), in, size(), offset_of(rank_), static_cast<int64_t>(count), kind, code, work_),
              "threads communicator: the reduction kernel did not launch");
    MOE_CUDA_CHECK(cudaStreamSynchronize(work_));
    state_->sync.arrive_and_wait();  // every rank has read every input
    copy_on_work(out, scratch.get(), bytes);
    MOE_CUDA_CHECK(cudaStreamSynchronize(work_));
    state_->sync.arrive_and_wait();
  }

  std::shared_ptr<GroupState> state_;
  int rank_;
  int ranks_per_node_;
  std::shared_ptr<void> scratch_;  // reduce_into's
  size_t scratch_bytes_ = 0;
  int64_t splits_ = 0;
  cudaStream_t caller_ = nullptr, work_ = nullptr;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int n, int ranks_per_node) {
  MOE_CHECK(n >= 1 && n <= kMaxRanks, "threads communicator: {} ranks (1 to {})", n, kMaxRanks);
  MOE_CHECK(ranks_per_node >= 0 && (ranks_per_node == 0 || n % ranks_per_node == 0),
            "threads communicator: nodes of {} ranks do not divide {} ranks", ranks_per_node, n);
  auto state = std::make_shared<GroupState>(n);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(std::make_unique<ThreadCommunicator>(state, r, ranks_per_node));
  return ranks;
}

}  // namespace moe::dist
