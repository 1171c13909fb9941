// Pieces the host backends share: a finished Work, argument checks, and element-wise
// reduction of host buffers for every DType (bf16 through float, rounded back).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"

namespace moe::dist {

class CompletedWork final : public Work {
 public:
  void wait() override {}
  bool done() override { return true; }
};

inline std::unique_ptr<Work> completed_work() { return std::make_unique<CompletedWork>(); }

const char* dtype_name(DType dtype);
const char* reduce_op_name(ReduceOp op);

// Throws unless counts has `peers` entries, none negative; returns their sum.
int64_t checked_count_sum(const std::vector<int64_t>& counts, int peers, const char* what);

// inout[i] = op(inout[i], in[i]) for count elements.
void reduce_into(void* inout, const void* in, size_t count, DType dtype, ReduceOp op);

// Exclusive prefix sums of counts (element offsets of each peer's block).
std::vector<int64_t> block_offsets(const std::vector<int64_t>& counts);

// Collectives on host values over any backend: through the backend's own memory when its
// collectives need device memory (nccl), directly otherwise. Blocking.
void all_gather_host(Communicator& comm, const void* send, void* recv, size_t send_count, DType dtype);
void all_reduce_host(Communicator& comm, void* data, size_t count, DType dtype, ReduceOp op);

}  // namespace moe::dist
