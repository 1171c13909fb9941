#include "dist/cuda/nccl_communicator.h"
#include "dist/topology.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <spdlog/spdlog.h>

#include <cstring>

#include "core/error.h"
#include "dist/comm_util.h"
#include "dist/mpi_communicator.h"
#include "dist/rendezvous.h"

namespace moe::dist {
namespace {

#define MOE_NCCL_CHECK(call)                                                                        \
  do {                                                                                              \
    const ncclResult_t nccl_status_ = (call);                                                       \
    if (nccl_status_ != ncclSuccess)                                                                \
      MOE_THROW("{} failed: {} ({})", #call, ncclGetErrorString(nccl_status_), ncclGetLastError(nullptr)); \
  } while (0)

#define MOE_CUDART_CHECK(call)                                                                \
  do {                                                                                        \
    const cudaError_t cuda_status_ = (call);                                                  \
    if (cuda_status_ != cudaSuccess) MOE_THROW("{} failed: {}", #call, cudaGetErrorString(cuda_status_)); \
  } while (0)

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
  }
  MOE_THROW("unknown communicator dtype {}", static_cast<int>(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  MOE_THROW("unknown reduce op {}", static_cast<int>(op));
}

// An event recorded on the communicator's stream after the operation.
class NcclWork final : public Work {
 public:
  NcclWork(cudaEvent_t event, cudaStream_t caller) : event_(event), caller_(caller) {}
  ~NcclWork() override { cudaEventDestroy(event_); }
  void wait() override { MOE_CUDART_CHECK(cudaStreamWaitEvent(caller_, event_, 0)); }
  bool done() override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    MOE_CUDART_CHECK(status);
    return true;
  }

 private:
  cudaEvent_t event_;
  cudaStream_t caller_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device) : comm_(comm), device_(device) {
    MOE_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    MOE_NCCL_CHECK(ncclCommCount(comm_, &size_));
    MOE_CUDART_CHECK(cudaSetDevice(device_));
    MOE_CUDART_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    MOE_CUDART_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    MOE_CUDART_CHECK(cudaMalloc(&barrier_word_, sizeof(int32_t)));
  }
  ~NcclCommunicator() override {
    ncclCommDestroy(comm_);
    cudaFree(barrier_word_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(comm_stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  void set_stream(void* stream) override { caller_ = static_cast<cudaStream_t>(stream); }
  bool device_memory() const override { return true; }
  std::shared_ptr<void> allocate(size_t bytes) override {
    MOE_CUDART_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    MOE_CUDART_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 1));
    return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
  }
  // On the caller's stream, where Work::wait() puts the collectives' completion.
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    MOE_CUDART_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, caller_));
  }
  void synchronize() override { MOE_CUDART_CHECK(cudaStreamSynchronize(caller_)); }

  std::unique_ptr<Work> all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op) override {
    begin();
    MOE_NCCL_CHECK(ncclAllReduce(data, data, count, nccl_type(dtype), nccl_op(op), comm_, comm_stream_));
    return finish();
  }
  std::unique_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DType dtype,
                                             ReduceOp op) override {
    begin();
    MOE_NCCL_CHECK(ncclReduceScatter(send, recv, recv_count, nccl_type(dtype), nccl_op(op), comm_, comm_stream_));
    return finish();
  }
  std::unique_ptr<Work> all_gather_async(const void* send, void* recv, size_t send_count, DType dtype) override {
    begin();
    MOE_NCCL_CHECK(ncclAllGather(send, recv, send_count, nccl_type(dtype), comm_, comm_stream_));
    return finish();
  }
  std::unique_ptr<Work> all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                           const std::vector<int64_t>& recv_counts, DType dtype) override {
    checked_count_sum(send_counts, size_, "send_counts");
    checked_count_sum(recv_counts, size_, "recv_counts");
    const std::vector<int64_t> send_offsets = block_offsets(send_counts), recv_offsets = block_offsets(recv_counts);
    const size_t elem = dtype_bytes(dtype);
    begin();
    // One group of point-to-point calls: NCCL runs them together, without deadlock.
    MOE_NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size_; ++p) {
      if (send_counts[p] > 0)
        MOE_NCCL_CHECK(ncclSend(static_cast<const char*>(send) + send_offsets[p] * elem,
                                static_cast<size_t>(send_counts[p]), nccl_type(dtype), p, comm_, comm_stream_));
      if (recv_counts[p] > 0)
        MOE_NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + recv_offsets[p] * elem,
                                static_cast<size_t>(recv_counts[p]), nccl_type(dtype), p, comm_, comm_stream_));
    }
    MOE_NCCL_CHECK(ncclGroupEnd());
    return finish();
  }
  std::unique_ptr<Work> broadcast_async(void* data, size_t count, DType dtype, int root) override {
    MOE_CHECK(root >= 0 && root < size_, "broadcast root {} outside a group of {} ranks", root, size_);
    begin();
    MOE_NCCL_CHECK(ncclBroadcast(data, data, count, nccl_type(dtype), root, comm_, comm_stream_));
    return finish();
  }
  void group_begin() override {
    MOE_CUDART_CHECK(cudaSetDevice(device_));
    MOE_NCCL_CHECK(ncclGroupStart());
  }
  std::unique_ptr<Work> group_end() override {
    MOE_NCCL_CHECK(ncclGroupEnd());
    return finish();  // after the group's launch on the communicator's stream
  }
  // Blocks the host until every rank got here (and the work before it on this stream ran).
  void barrier() override {
    begin();
    MOE_NCCL_CHECK(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, comm_, comm_stream_));
    MOE_CUDART_CHECK(cudaStreamSynchronize(comm_stream_));
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    ncclComm_t sub = nullptr;
    MOE_NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    if (sub == nullptr) return nullptr;
    auto result = std::make_unique<NcclCommunicator>(sub, device_);
    result->caller_ = caller_;
    return result;
  }

 private:
  // The communicator's stream waits for what the caller enqueued so far.
  void begin() {
    MOE_CUDART_CHECK(cudaSetDevice(device_));
    MOE_CUDART_CHECK(cudaEventRecord(ready_, caller_));
    MOE_CUDART_CHECK(cudaStreamWaitEvent(comm_stream_, ready_, 0));
  }
  std::unique_ptr<Work> finish() {
    cudaEvent_t done = nullptr;
    MOE_CUDART_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    MOE_CUDART_CHECK(cudaEventRecord(done, comm_stream_));
    return std::make_unique<NcclWork>(done, caller_);
  }

  ncclComm_t comm_;
  int device_;
  int rank_ = 0, size_ = 1;
  cudaStream_t comm_stream_ = nullptr;
  cudaStream_t caller_ = nullptr;  // the legacy default stream until set_stream
  cudaEvent_t ready_ = nullptr;
  int32_t* barrier_word_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_world(const LaunchEnv& env) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    MOE_CONFIG_ERROR("backend 'nccl' needs a GPU, and none is visible");
  const int device = env.device_rank % devices;  // the real node's index, not a simulated one
  MOE_CUDART_CHECK(cudaSetDevice(device));
  bind_worker(env, device);  // the CPUs of the GPU's NUMA node, where the machine says
  ncclUniqueId id;
  if (env.rank == 0) MOE_NCCL_CHECK(ncclGetUniqueId(&id));
  if (env.world_size > 1) {
    if (launched_by_mpi()) {
      auto mpi = make_mpi_world();
      mpi->broadcast(&id, sizeof id, DType::u8, 0);
    } else {
      const std::string mine = env.rank == 0 ? std::string(reinterpret_cast<const char*>(&id), sizeof id) : "";
      const auto entries =
          rendezvous_all_gather(env.master_addr, env.rendezvous_port, env.rank, env.world_size, "nccl-id", mine);
      MOE_CHECK(entries[0].payload.size() == sizeof id, "rendezvous: rank 0 sent a {}-byte NCCL id",
                entries[0].payload.size());
      std::memcpy(&id, entries[0].payload.data(), sizeof id);
    }
  }
  ncclComm_t comm = nullptr;
  MOE_NCCL_CHECK(ncclCommInitRank(&comm, env.world_size, id, env.rank));
  spdlog::info("nccl: rank {}/{} on GPU {}", env.rank, env.world_size, device);
  return std::make_unique<NcclCommunicator>(comm, device);
}

}  // namespace moe::dist
