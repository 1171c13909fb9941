#include "dist/mpi_communicator.h"

#include <mpi.h>
#include <spdlog/spdlog.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "core/error.h"
#include "dist/comm_util.h"

namespace moe::dist {
namespace {

int64_t g_max_message_elements = INT_MAX;

#define MOE_MPI_CHECK(call)                                                             \
  do {                                                                                  \
    const int mpi_status_ = (call);                                                     \
    if (mpi_status_ != MPI_SUCCESS) {                                                   \
      char mpi_text_[MPI_MAX_ERROR_STRING];                                             \
      int mpi_len_ = 0;                                                                 \
      MPI_Error_string(mpi_status_, mpi_text_, &mpi_len_);                              \
      MOE_THROW("{} failed: {}", #call, std::string(mpi_text_, static_cast<size_t>(mpi_len_))); \
    }                                                                                   \
  } while (0)

// Initialises MPI once; finalises it when the process exits (static destruction), if
// nobody else did.
class MpiRuntime {
 public:
  static MpiRuntime& get() {
    static MpiRuntime runtime;
    return runtime;
  }
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (initialized_here_ && !finalized) MPI_Finalize();
  }
  // bf16 reductions: user ops over MPI_UINT16_T (MPI has no bfloat16).
  MPI_Op bf16_op(ReduceOp op) const { return bf16_ops_[static_cast<int>(op)]; }

 private:
  MpiRuntime() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      // Communication may be driven from a thread of its own (overlap with compute).
      MOE_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
      initialized_here_ = true;
      if (provided < MPI_THREAD_SERIALIZED)
        spdlog::warn("MPI provides thread level {} only: call collectives from one thread", provided);
    }
    // Errors come back as codes so that they become exceptions with a message.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Op_create(&bf16_reduce<ReduceOp::sum>, 1, &bf16_ops_[0]);
    MPI_Op_create(&bf16_reduce<ReduceOp::max>, 1, &bf16_ops_[1]);
    MPI_Op_create(&bf16_reduce<ReduceOp::min>, 1, &bf16_ops_[2]);
  }
  template <ReduceOp kOp>
  static void bf16_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
    reduce_into(inout, in, static_cast<size_t>(*len), DType::bf16, kOp);
  }
  bool initialized_here_ = false;
  MPI_Op bf16_ops_[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::bf16: return MPI_UINT16_T;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
  }
  MOE_THROW("unknown communicator dtype {}", static_cast<int>(dtype));
}

MPI_Op mpi_op(ReduceOp op, DType dtype) {
  if (dtype == DType::bf16) return MpiRuntime::get().bf16_op(op);
  switch (op) {
    case ReduceOp::sum: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  MOE_THROW("unknown reduce op {}", static_cast<int>(op));
}

// Requests in flight plus the arrays MPI reads until they complete (alltoallv counts), and
// what is left to do once they have (an in-place reduce-scatter's move).
class MpiWork final : public Work {
 public:
  std::vector<MPI_Request> requests;
  std::vector<int> counts_and_offsets;
  std::function<void()> on_complete;

  ~MpiWork() override {
    // A Work dropped without wait(): complete it anyway, the buffers belong to the caller.
    if (!requests.empty()) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized && MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE) == MPI_SUCCESS)
        complete();
    }
  }
  void wait() override {
    if (requests.empty()) return;
    MOE_MPI_CHECK(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
    complete();
  }
  bool done() override {
    if (requests.empty()) return true;
    int flag = 0;
    MOE_MPI_CHECK(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag, MPI_STATUSES_IGNORE));
    if (flag) complete();
    return flag != 0;
  }

 private:
  void complete() {
    requests.clear();
    if (on_complete) std::exchange(on_complete, nullptr)();
  }
};

const char* byte_ptr(const void* p, int64_t elements, DType dtype) {
  return static_cast<const char*>(p) + elements * static_cast<int64_t>(dtype_bytes(dtype));
}
char* byte_ptr(void* p, int64_t elements, DType dtype) {
  return static_cast<char*>(p) + elements * static_cast<int64_t>(dtype_bytes(dtype));
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  std::unique_ptr<Work> all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op) override {
    auto work = std::make_unique<MpiWork>();
    for (int64_t begin = 0; begin < static_cast<int64_t>(count); begin += g_max_message_elements) {
      const int64_t n = std::min<int64_t>(g_max_message_elements, static_cast<int64_t>(count) - begin);
      work->requests.emplace_back();
      MOE_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, byte_ptr(data, begin, dtype), static_cast<int>(n), mpi_type(dtype),
                                   mpi_op(op, dtype), comm_, &work->requests.back()));
    }
    return work;
  }

  std::unique_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DType dtype,
                                             ReduceOp op) override {
    check_fits_int(recv_count, "reduce_scatter recv_count");
    auto work = std::make_unique<MpiWork>();
    work->requests.emplace_back();
    // In place (as NCCL): recv is this rank's block of send. MPI_IN_PLACE takes the input
    // from the whole buffer and leaves this rank's sums at its start: moved to recv after.
    const bool in_place = recv == byte_ptr(send, static_cast<int64_t>(recv_count) * rank_, dtype);
    void* whole = const_cast<void*>(send);
    if (in_place && whole != recv) {
      const size_t bytes = recv_count * dtype_bytes(dtype);
      work->on_complete = [whole, recv, bytes] { std::memmove(recv, whole, bytes); };
    }
    MOE_MPI_CHECK(MPI_Ireduce_scatter_block(in_place ? MPI_IN_PLACE : send, in_place ? whole : recv,
                                            static_cast<int>(recv_count), mpi_type(dtype), mpi_op(op, dtype), comm_,
                                            &work->requests.back()));
    return work;
  }

  std::unique_ptr<Work> all_gather_async(const void* send, void* recv, size_t send_count, DType dtype) override {
    check_fits_int(send_count, "all_gather send_count");
    auto work = std::make_unique<MpiWork>();
    work->requests.emplace_back();
    // send may alias this rank's block of recv (in-place all-gather).
    const bool in_place = send == byte_ptr(recv, static_cast<int64_t>(send_count) * rank_, dtype);
    MOE_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, static_cast<int>(send_count), mpi_type(dtype), recv,
                                 static_cast<int>(send_count), mpi_type(dtype), comm_, &work->requests.back()));
    return work;
  }

  std::unique_ptr<Work> all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                           const std::vector<int64_t>& recv_counts, DType dtype) override {
    const int64_t send_total = checked_count_sum(send_counts, size_, "send_counts");
    const int64_t recv_total = checked_count_sum(recv_counts, size_, "recv_counts");
    auto work = std::make_unique<MpiWork>();
    if (send_total <= g_max_message_elements && recv_total <= g_max_message_elements) {
      // Every count and offset fits an int: one MPI_Ialltoallv.
      auto& arrays = work->counts_and_offsets;
      arrays.resize(4 * static_cast<size_t>(size_));
      const std::vector<int64_t> send_offsets = block_offsets(send_counts), recv_offsets = block_offsets(recv_counts);
      for (int p = 0; p < size_; ++p) {
        arrays[p] = static_cast<int>(send_counts[p]);
        arrays[size_ + p] = static_cast<int>(send_offsets[p]);
        arrays[2 * size_ + p] = static_cast<int>(recv_counts[p]);
        arrays[3 * size_ + p] = static_cast<int>(recv_offsets[p]);
      }
      work->requests.emplace_back();
      MOE_MPI_CHECK(MPI_Ialltoallv(send, arrays.data(), arrays.data() + size_, mpi_type(dtype), recv,
                                   arrays.data() + 2 * size_, arrays.data() + 3 * size_, mpi_type(dtype), comm_,
                                   &work->requests.back()));
      return work;
    }
    // Large: point-to-point messages of at most g_max_message_elements each; pairs
    // keep their order (MPI messages with the same tag do not overtake).
    const std::vector<int64_t> send_offsets = block_offsets(send_counts), recv_offsets = block_offsets(recv_counts);
    for (int p = 0; p < size_; ++p) {
      for (int64_t begin = 0; begin < recv_counts[p]; begin += g_max_message_elements) {
        const int64_t n = std::min(g_max_message_elements, recv_counts[p] - begin);
        work->requests.emplace_back();
        MOE_MPI_CHECK(MPI_Irecv(byte_ptr(recv, recv_offsets[p] + begin, dtype), static_cast<int>(n), mpi_type(dtype),
                                p, kAllToAllTag, comm_, &work->requests.back()));
      }
    }
    for (int p = 0; p < size_; ++p) {
      for (int64_t begin = 0; begin < send_counts[p]; begin += g_max_message_elements) {
        const int64_t n = std::min(g_max_message_elements, send_counts[p] - begin);
        work->requests.emplace_back();
        MOE_MPI_CHECK(MPI_Isend(byte_ptr(send, send_offsets[p] + begin, dtype), static_cast<int>(n), mpi_type(dtype),
                                p, kAllToAllTag, comm_, &work->requests.back()));
      }
    }
    return work;
  }

  std::unique_ptr<Work> broadcast_async(void* data, size_t count, DType dtype, int root) override {
    MOE_CHECK(root >= 0 && root < size_, "broadcast root {} outside a group of {} ranks", root, size_);
    auto work = std::make_unique<MpiWork>();
    for (int64_t begin = 0; begin < static_cast<int64_t>(count); begin += g_max_message_elements) {
      const int64_t n = std::min<int64_t>(g_max_message_elements, static_cast<int64_t>(count) - begin);
      work->requests.emplace_back();
      MOE_MPI_CHECK(MPI_Ibcast(byte_ptr(data, begin, dtype), static_cast<int>(n), mpi_type(dtype), root, comm_,
                               &work->requests.back()));
    }
    return work;
  }

  void barrier() override { MOE_MPI_CHECK(MPI_Barrier(comm_)); }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    MOE_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub));
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiCommunicator>(sub);
  }

 private:
  static constexpr int kAllToAllTag = 7301;
  static void check_fits_int(size_t count, const char* what) {
    MOE_CHECK(static_cast<int64_t>(count) <= g_max_message_elements,
              "{} = {} exceeds the MPI backend's limit of {} elements per message", what, count,
              g_max_message_elements);
  }
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
         std::getenv("PMI_RANK") != nullptr;
}

std::unique_ptr<Communicator> make_mpi_world() {
  MpiRuntime::get();
  MPI_Comm world = MPI_COMM_NULL;
  // A duplicate: our collectives never mix with anyone else's on MPI_COMM_WORLD.
  MOE_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &world));
  return std::make_unique<MpiCommunicator>(world);
}

void set_mpi_max_message_elements(int64_t max_elements) {
  MOE_CHECK(max_elements >= 0 && max_elements <= INT_MAX, "max message elements {} outside [0, INT_MAX]",
            max_elements);
  g_max_message_elements = max_elements == 0 ? INT_MAX : max_elements;
}

void abort_mpi_world_if_running(int exit_code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return;
  MPI_Finalized(&finalized);
  if (finalized) return;
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) MPI_Abort(MPI_COMM_WORLD, exit_code);
}

}  // namespace moe::dist
