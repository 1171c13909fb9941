// The reductions of the threads communicator (dist/cuda/thread_communicator.cpp).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "dist/cuda/thread_reduce.h"

namespace moe::dist {
namespace {

template <typename T>
__device__ __forceinline__ double load_as_double(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return static_cast<double>(__bfloat162float(p[i]));
  else return static_cast<double>(p[i]);
}

// out[i] = op over ranks 0 .. n-1 (in order) of in_r[offset + i]; fp32 sums for f32 and
// bf16 (as NCCL's), doubles for f64, exact integers.
template <typename T, typename Acc>
__global__ void reduce_kernel(T* out, RankPointers in, int n, int64_t offset, int64_t count, int op) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  Acc acc = static_cast<Acc>(load_as_double(static_cast<const T*>(in.p[0]), offset + i));
  for (int r = 1; r < n; ++r) {
    const Acc x = static_cast<Acc>(load_as_double(static_cast<const T*>(in.p[r]), offset + i));
    acc = op == 0 ? acc + x : op == 1 ? (x > acc ? x : acc) : (x < acc ? x : acc);
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16>) out[i] = __float2bfloat16(static_cast<float>(acc));
  else out[i] = static_cast<T>(acc);
}

template <typename T, typename Acc>
void launch(void* out, const RankPointers& in, int n, int64_t offset, int64_t count, int op, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((count + 255) / 256);
  reduce_kernel<T, Acc><<<blocks, 256, 0, stream>>>(static_cast<T*>(out), in, n, offset, count, op);
}

}  // namespace

bool reduce_ranks(void* out, const RankPointers& in, int n, int64_t offset, int64_t count, ReduceKind kind, int op,
                  void* stream) {
  if (count <= 0) return true;
  auto s = static_cast<cudaStream_t>(stream);
  switch (kind) {
    case ReduceKind::f32: launch<float, float>(out, in, n, offset, count, op, s); break;
    case ReduceKind::f64: launch<double, double>(out, in, n, offset, count, op, s); break;
    case ReduceKind::bf16: launch<__nv_bfloat16, float>(out, in, n, offset, count, op, s); break;
    case ReduceKind::i32: launch<int32_t, int64_t>(out, in, n, offset, count, op, s); break;
    case ReduceKind::i64: launch<int64_t, int64_t>(out, in, n, offset, count, op, s); break;
  }
  return cudaGetLastError() == cudaSuccess;
}

}  // namespace moe::dist
