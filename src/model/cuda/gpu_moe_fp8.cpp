// The experts' forward and data-gradient GEMMs in the run's precision: bf16 through
// ExpertGemm, or (training.precision = fp8) e4m3 through ExpertGemmFp8 with the operands
// quantised right before the GEMM (rows per 1 x 128 tile over the expert offsets, weights
// per 128 x 128 block; docs/FP8.md). Weight gradients stay bf16 (gpu_moe.cpp).
#include "core/error.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"
#include "model/cuda/gpu_transformer_state.h"

namespace moe {

void GpuTransformer::State::expert_forward(const Layer& layer, const MoEBuffers& m, int sets, bf16* const* out,
                                           int64_t ld_out, const bf16* x, int64_t ld_x, const bf16* const* w,
                                           int64_t N, int64_t K) {
  const int32_t* offsets = expert_offsets(m);
  if (!fp8) {
    expert_gemm->forward(sets, out, ld_out, x, ld_x, w, offsets, N, K, stream);
    return;
  }
  const int64_t E = local_experts(layer), R = expert_rows(m);
  if (E == 0) return;
  MOE_CHECK(R * K <= static_cast<int64_t>(fp8_rows.size()) && sets <= 2, "fp8 experts: scratch for {} x {} rows", R, K);
  cuda::quantize_rows_blockwise(fp8_rows.data(), fp8_row_scales.data(), x, ld_x, offsets, E, R, K, stream);
  const int64_t codes = E * N * K, scales = E * fp8::blocks(N) * fp8::blocks(K);
  const uint8_t* w_codes[2] = {};
  const float* w_scales[2] = {};
  for (int s = 0; s < sets; ++s) {
    uint8_t* c = fp8_weights.data() + s * codes;
    float* sc = fp8_weight_scales.data() + s * scales;
    cuda::quantize_weight_blocks(c, sc, nullptr, nullptr, w[s], E, N, K, stream);
    w_codes[s] = c;
    w_scales[s] = sc;
  }
  expert_gemm_fp8->forward(sets, out, ld_out, fp8_rows.data(), fp8_row_scales.data(), w_codes, w_scales, offsets, N,
                           K, stream);
}

void GpuTransformer::State::expert_backward_data(const Layer& layer, const MoEBuffers& m, bf16* out, int64_t ld_out,
                                                 const bf16* dy, int64_t ld_dy, const bf16* w, int64_t N, int64_t K,
                                                 float beta) {
  const int32_t* offsets = expert_offsets(m);
  if (!fp8) {
    expert_gemm->backward_data(out, ld_out, dy, ld_dy, w, offsets, N, K, beta, stream);
    return;
  }
  const int64_t E = local_experts(layer), R = expert_rows(m);
  if (E == 0) return;
  MOE_CHECK(R * K <= static_cast<int64_t>(fp8_rows.size()), "fp8 experts: scratch for {} x {} rows", R, K);
  cuda::quantize_rows_blockwise(fp8_rows.data(), fp8_row_scales.data(), dy, ld_dy, offsets, E, R, K, stream);
  // W_e is the Linear weight [K, N] (K outputs, N inputs); the GEMM takes its quantised
  // transpose [N, K], which the weight quantisation writes alone here.
  cuda::quantize_weight_blocks(nullptr, nullptr, fp8_weights.data(), fp8_weight_scales.data(), w, E, K, N, stream);
  expert_gemm_fp8->backward_data(out, ld_out, fp8_rows.data(), fp8_row_scales.data(), fp8_weights.data(),
                                 fp8_weight_scales.data(), offsets, N, K, beta, stream);
}

}  // namespace moe
