// A block's attention on the GPU with one fused q|k|v projection. wq [H d, D], wk and wv
// [G d, D] lie back to back in the parameter store (checked when the model is built), so
// [wq; wk; wv] is one [(H + 2G) d, D] matrix and its gradient one [(H + 2G) d, D] block:
// - forward: one GEMM n1 @ [wq; wk; wv]^T into qkv [T, (H + 2G) d] (a token's q heads,
//   then its k and v heads), RoPE on the q and k heads in one launch, cuDNN SDPA reading
//   q, k and v where they lie (row stride (H + 2G) d), the output projection;
// - backward: SDPA writes dq, dk, dv into one [T, (H + 2G) d] buffer the same way, RoPE's
//   transpose on its q and k heads, then ONE data-gradient GEMM dqkv @ [wq; wk; wv] and ONE
//   weight-gradient GEMM dqkv^T @ n1 (fp32, accumulated into the three gradients).
// The CPU model (model/attention.cpp) computes the same with three projections.
#include <cmath>

#include "kernels/fp8_gpu_ops.h"
#include "kernels/gpu_ops.h"
#include "model/cuda/gpu_transformer_state.h"

namespace moe {

void GpuTransformer::State::attention_forward(Layer& layer, bf16* y, bool n1_quantised) {
  const ModelConfig& c = config;
  const int64_t T = tokens, D = c.dim, H = c.n_heads, G = c.n_kv_heads, d = c.head_dim();
  const int64_t N = qkv_width();  // a token's q|k|v row
  Activations& a = *layer.act;
  AttentionBuffers& at = a.attn;
  bf16* q = at.qkv.data();
  projection(q, a.n1.data(), w(layer.wq), T, D, N, false, N, n1_quantised);
  cuda::rope_forward(q, positions.data(), rope_cos_sin.data(), T, H + G, d, stream, N);
  attention.forward(at.out.data(), at.stats.data(), q, q + H * d, q + (H + G) * d, batch, c.seq_len, H, G, d,
                    attention_scale(d), stream, N, N);
  projection(y, at.out.data(), w(layer.wo), T, H * d, D, false);
}

void GpuTransformer::State::attention_backward(Layer& layer, bf16* dx, const bf16* dy) {
  const ModelConfig& c = config;
  const int64_t T = tokens, D = c.dim, H = c.n_heads, G = c.n_kv_heads, d = c.head_dim();
  const int64_t N = qkv_width();
  Activations& a = *layer.act;
  AttentionBuffers& at = a.attn;
  projection_backward(dattn.data(), g(layer.wo), dy, at.out.data(), w(layer.wo), T, H * d, D, false);
  const bf16* q = at.qkv.data();
  bf16* dq = dqkv.data();
  attention.backward(dq, dq + H * d, dq + (H + G) * d, dattn.data(), q, q + H * d, q + (H + G) * d, at.out.data(),
                     at.stats.data(), batch, c.seq_len, H, G, d, attention_scale(d), stream, N,
                     N);
  // fp8: RoPE's backward also writes the codes of dq|dk|dv for the data-gradient GEMM.
  const cuda::RowCodes dq_codes = projections->backward_row_codes(T, D, N, N);
  if (dq_codes.codes_RK)
    cuda::rope_backward_fp8(dq, dq_codes, positions.data(), rope_cos_sin.data(), T, H + G, H + 2 * G, d, stream);
  else
    cuda::rope_backward(dq, positions.data(), rope_cos_sin.data(), T, H + G, d, stream, N);
  // g(wq) starts the [(H + 2G) d, D] gradient block of wq, wk and wv.
  projection_backward(dx, g(layer.wq), dq, a.n1.data(), w(layer.wq), T, D, N, false, N, dq_codes.codes_RK != nullptr);
}

}  // namespace moe
