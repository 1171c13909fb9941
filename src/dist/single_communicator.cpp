#include "dist/single_communicator.h"

#include <cstring>

#include "core/error.h"
#include "dist/comm_util.h"

namespace moe::dist {
namespace {

// memmove: callers may pass the same buffer as send and recv.
void copy_elements(void* dst, const void* src, size_t count, DType dtype) {
  if (count != 0 && dst != src) std::memmove(dst, src, count * dtype_bytes(dtype));
}

class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }

  std::unique_ptr<Work> all_reduce_async(void*, size_t, DType, ReduceOp) override { return completed_work(); }
  std::unique_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DType dtype,
                                             ReduceOp) override {
    copy_elements(recv, send, recv_count, dtype);
    return completed_work();
  }
  std::unique_ptr<Work> all_gather_async(const void* send, void* recv, size_t send_count, DType dtype) override {
    copy_elements(recv, send, send_count, dtype);
    return completed_work();
  }
  std::unique_ptr<Work> all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                           const std::vector<int64_t>& recv_counts, DType dtype) override {
    const int64_t sent = checked_count_sum(send_counts, 1, "send_counts");
    const int64_t received = checked_count_sum(recv_counts, 1, "recv_counts");
    MOE_CHECK(sent == received, "a world of one sends {} elements to itself but expects {}", sent, received);
    copy_elements(recv, send, static_cast<size_t>(sent), dtype);
    return completed_work();
  }
  std::unique_ptr<Work> broadcast_async(void*, size_t, DType, int root) override {
    MOE_CHECK(root == 0, "broadcast root {} outside a world of one", root);
    return completed_work();
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int color, int) override {
    if (color < 0) return nullptr;
    return std::make_unique<SingleCommunicator>();
  }
};

}  // namespace

std::unique_ptr<Communicator> make_single_communicator() { return std::make_unique<SingleCommunicator>(); }

}  // namespace moe::dist
