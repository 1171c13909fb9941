// Token embedding on the GPU. The backward sorts tokens by id (CUB's stable radix sort)
// so each id's gradient rows are summed in token order by one block: deterministic,
// no atomics.
#include <cub/device/device_radix_sort.cuh>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void embedding_forward_kernel(__nv_bfloat16* out, const int32_t* ids, const __nv_bfloat16* table,
                                         int64_t D) {
  const int64_t t = blockIdx.x;
  const __nv_bfloat16* row = table + static_cast<int64_t>(ids[t]) * D;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) out[t * D + i] = row[i];
}

__global__ void iota_kernel(int32_t* values, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) values[i] = static_cast<int32_t>(i);
}

// Block b looks at sorted position b: if it starts a run of equal ids, it sums the run.
__global__ void embedding_backward_kernel(float* dtable, const int32_t* sorted_ids, const int32_t* sorted_tokens,
                                          const __nv_bfloat16* dout, int64_t T, int64_t D) {
  const int64_t start = blockIdx.x;
  const int32_t id = sorted_ids[start];
  if (start > 0 && sorted_ids[start - 1] == id) return;
  int64_t end = start + 1;
  while (end < T && sorted_ids[end] == id) ++end;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    float sum = 0.0f;
    for (int64_t p = start; p < end; ++p) sum += to_float(dout[static_cast<int64_t>(sorted_tokens[p]) * D + i]);
    dtable[static_cast<int64_t>(id) * D + i] += sum;
  }
}

// Scratch layout: sorted ids, token indices, sorted token indices, then CUB's storage.
size_t cub_bytes(int64_t T) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<int>(T));
  return bytes;
}

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

void embedding_forward(bf16* out_TD, const int32_t* ids_T, const bf16* table_VD, int64_t T, int64_t V, int64_t D,
                       Stream stream) {
  if (T == 0) return;
  embedding_forward_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(as_cuda(out_TD), ids_T,
                                                                               as_cuda(table_VD), D);
  MOE_CUDA_CHECK_LAUNCH();
}

size_t embedding_backward_scratch_bytes(int64_t T) {
  return 3 * aligned(static_cast<size_t>(T) * sizeof(int32_t)) + aligned(cub_bytes(T));
}

void embedding_backward(float* dtable_VD, const int32_t* ids_T, const bf16* dout_TD, int64_t T, int64_t V, int64_t D,
                        void* scratch, size_t scratch_bytes, Stream stream) {
  if (T == 0) return;
  MOE_CHECKF(scratch_bytes >= embedding_backward_scratch_bytes(T), "embedding_backward: scratch too small");
  char* p = static_cast<char*>(scratch);
  const size_t ints = aligned(static_cast<size_t>(T) * sizeof(int32_t));
  auto* sorted_ids = reinterpret_cast<int32_t*>(p);
  auto* tokens = reinterpret_cast<int32_t*>(p + ints);
  auto* sorted_tokens = reinterpret_cast<int32_t*>(p + 2 * ints);
  void* cub_storage = p + 3 * ints;
  size_t cub_storage_bytes = cub_bytes(T);
  iota_kernel<<<static_cast<unsigned>(ceil_div(T, kThreads)), kThreads, 0, stream>>>(tokens, T);
  MOE_CUDA_CHECK_LAUNCH();
  int end_bit = 1;
  while (end_bit < 31 && (int64_t{1} << end_bit) < V) ++end_bit;  // sort only the bits ids use
  MOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_storage, cub_storage_bytes, ids_T, sorted_ids, tokens,
                                                 sorted_tokens, static_cast<int>(T), 0, end_bit, stream));
  embedding_backward_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(dtable_VD, sorted_ids, sorted_tokens,
                                                                               as_cuda(dout_TD), T, D);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
