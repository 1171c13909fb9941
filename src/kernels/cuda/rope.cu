// RoPE on the GPU, rotate_half layout: pairs (i, i + d/2), angle pos * theta^(-2i/d).
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

// direction +1 rotates (forward), -1 rotates back (the transpose, for the backward).
__global__ void rope_kernel(__nv_bfloat16* x, const int32_t* positions, int64_t T, int64_t N,
                            int64_t d, float log2_theta, float direction) {
  const int64_t half = d / 2;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= T * N * half) return;
  const int64_t i = idx % half, tn = idx / half, t = tn / N;
  const float inv_freq = exp2f(-2.0f * static_cast<float>(i) / static_cast<float>(d) * log2_theta);
  float s, c;
  sincosf(static_cast<float>(positions[t]) * inv_freq, &s, &c);
  s *= direction;
  __nv_bfloat16* head = x + tn * d;
  const float a = to_float(head[i]), b = to_float(head[i + half]);
  head[i] = to_bf16(a * c - b * s);
  head[i + half] = to_bf16(b * c + a * s);
}

void launch(bf16* x, const int32_t* positions, int64_t T, int64_t N, int64_t d, float theta,
            float direction, Stream stream) {
  MOE_CHECKF(d % 2 == 0, "rope: head dim %lld must be even", static_cast<long long>(d));
  const int64_t work = T * N * (d / 2);
  if (work == 0) return;
  rope_kernel<<<static_cast<unsigned>(ceil_div(work, kThreads)), kThreads, 0, stream>>>(
      as_cuda(x), positions, T, N, d, log2f(theta), direction);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_forward(bf16* x_TNd, const int32_t* positions_T, int64_t T, int64_t N, int64_t d,
                  float theta, Stream stream) {
  launch(x_TNd, positions_T, T, N, d, theta, 1.0f, stream);
}

void rope_backward(bf16* dx_TNd, const int32_t* positions_T, int64_t T, int64_t N, int64_t d,
                   float theta, Stream stream) {
  launch(dx_TNd, positions_T, T, N, d, theta, -1.0f, stream);
}

}  // namespace moe::cuda
