// One interface in front of the collective backends: MPI (CPU buffers), NCCL (device
// buffers, enqueued on a CUDA stream) and a single-process backend (world of one, copies).
// Counts are in elements. Every rank of the communicator must call a collective with the
// same sizes (all_to_all_v: send_counts of rank r to peer p == recv_counts of p from r).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/parallel_config.h"

namespace moe::dist {

enum class DType { f32, f64, bf16, i32, i64, u8 };
enum class ReduceOp { sum, max, min };

size_t dtype_bytes(DType dtype);

// An operation in flight (non-blocking collectives). wait() returns when the result
// buffer may be read: for MPI when the request has completed, for NCCL when the work is
// ordered before the caller's stream (it does not block the host).
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  // True once the operation has completed (never blocks).
  virtual bool done() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "mpi", "nccl" or "single".
  virtual std::string backend() const = 0;

  // In place: data holds count elements on every rank.
  virtual std::unique_ptr<Work> all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op) = 0;
  // send holds size() * recv_count elements, block r going to rank r. In place (as NCCL):
  // recv = send + rank() * recv_count, this rank's own block (the other blocks of send are
  // then undefined).
  virtual std::unique_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DType dtype,
                                                     ReduceOp op) = 0;
  // recv gets size() * send_count elements, block r from rank r. In place: send = recv +
  // rank() * send_count.
  virtual std::unique_ptr<Work> all_gather_async(const void* send, void* recv, size_t send_count, DType dtype) = 0;
  // send and recv are packed by peer (peer 0's block first); counts have size() entries.
  virtual std::unique_ptr<Work> all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts,
                                                   void* recv, const std::vector<int64_t>& recv_counts,
                                                   DType dtype) = 0;
  virtual std::unique_ptr<Work> broadcast_async(void* data, size_t count, DType dtype, int root) = 0;
  virtual void barrier() = 0;

  // Ranks with the same color form a new communicator, ordered by key (MPI_Comm_split,
  // ncclCommSplit). Collective over this communicator.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // Device backends (nccl): `stream` (a cudaStream_t; nullptr = the default stream) is the
  // caller's stream. Each collective starts after the work already enqueued on it, runs
  // on the communicator's own stream (so later work on `stream` overlaps it), and
  // Work::wait() makes `stream` wait for it. Host backends ignore this.
  virtual void set_stream(void* stream) {}
  // Device backends (nccl): the collectives issued between group_begin() and group_end()
  // launch together as one (ncclGroupStart/End: one kernel for many small buckets);
  // group_end()'s Work marks the completion of all of them, theirs mean nothing. Host
  // backends: no-ops, and group_end() returns null (each collective's own Work holds).
  virtual void group_begin() {}
  virtual std::unique_ptr<Work> group_end() { return nullptr; }

  // Memory of the kind this backend's collectives read and write: host memory, or device
  // memory for nccl (device_memory()). allocate's buffers are freed with the last owner;
  // copy moves bytes between such buffers or to and from host memory, ordered with this
  // communicator's collectives (after the ones already waited for, before later ones);
  // synchronize returns once every copy and waited-for collective is complete, so the
  // host may read what a copy wrote to host memory.
  virtual bool device_memory() const { return false; }
  // How many consecutive ranks form a node, for backends whose ranks are not a launch's
  // processes (threads on one GPU simulating nodes); 0: the launch environment says.
  virtual int ranks_per_node() const { return 0; }
  virtual std::shared_ptr<void> allocate(size_t bytes);
  virtual void copy(void* dst, const void* src, size_t bytes);
  virtual void synchronize() {}

  // Blocking forms.
  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op = ReduceOp::sum) {
    all_reduce_async(data, count, dtype, op)->wait();
  }
  void reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op = ReduceOp::sum) {
    reduce_scatter_async(send, recv, recv_count, dtype, op)->wait();
  }
  void all_gather(const void* send, void* recv, size_t send_count, DType dtype) {
    all_gather_async(send, recv, send_count, dtype)->wait();
  }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts, DType dtype) {
    all_to_all_v_async(send, send_counts, recv, recv_counts, dtype)->wait();
  }
  void broadcast(void* data, size_t count, DType dtype, int root) { broadcast_async(data, count, dtype, root)->wait(); }
};

// ---- Construction (src/dist/communicator.cpp) ----------------------------------------

// The world of this process. Single: a world of one; Mpi: MPI_COMM_WORLD (needs mpirun
// or srun); Tcp: host buffers over sockets (needs the torchrun-style variables that
// `moe launch` sets); Nccl: device buffers (the unique id travels by MPI broadcast under
// mpirun, else by the TCP rendezvous at MASTER_ADDR:MASTER_PORT); Auto: single for a
// world of one, mpi under mpirun/srun, tcp under `moe launch`.
// Collective over all ranks of the launch.
std::unique_ptr<Communicator> make_world_communicator(CommBackend backend);

}  // namespace moe::dist
