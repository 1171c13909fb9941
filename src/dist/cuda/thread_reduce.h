// The element-wise reductions over several ranks' device buffers of the threads
// communicator (dist/cuda/thread_communicator.h).
#pragma once
#include <cstdint>

namespace moe::dist {

constexpr int kMaxThreadRanks = 16;
struct RankPointers {
  const void* p[kMaxThreadRanks];
};
enum class ReduceKind { f32, f64, bf16, i32, i64 };

// out[i] = op (0 sum, 1 max, 2 min) over in.p[0 .. n) of element offset + i, ranks in
// order, on `stream` (a cudaStream_t). False if the launch failed.
bool reduce_ranks(void* out, const RankPointers& in, int n, int64_t offset, int64_t count, ReduceKind kind, int op,
                  void* stream);

}  // namespace moe::dist
