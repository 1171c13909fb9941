// The experts' forward and data-gradient GEMMs in the run's precision: bf16 through
// ExpertGemm, or (training.precision = fp8) e4m3 through ExpertGemmFp8: the rows quantised
// right before each GEMM (1 x 128 tiles over the expert offsets), the weights (128 x 128
// blocks) once after they change into the layer's Fp8ExpertWeights, or, without that
// cache (GpuModelOptions::fp8_weight_cache off), right before each GEMM as well. The same
// kernels on the same inputs: both give the same bits (docs/FP8.md). The weight
// gradients: bf16 GEMMs, or (training.fp8_weight_gradients) ExpertWeightGemmFp8 over
// token columns. training.swiglu_in_gemm (bf16): the gate|up GEMM with SwiGLU and the down
// data gradient with SwiGLU's backward, each one kernel (PaddedExpertGemmBf16).
#include "core/error.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"
#include "model/cuda/gpu_transformer_state.h"
#include "model/gpu_buffer_sizes.h"

namespace moe {

namespace {

// The bf16 weights' tensor: the gate|up operand is w1's (local_w's [2F, D] an expert) where
// gate|up is interleaved.
const Param& expert_tensor(const Layer& layer, int tensor, bool gate_up_interleaved) {
  MOE_CHECK(tensor != Fp8ExpertWeights::kGateUp || gate_up_interleaved,
            "experts: the gate|up operand is no stored tensor");
  return tensor == Fp8ExpertWeights::kW1 || tensor == Fp8ExpertWeights::kGateUp ? layer.w1
         : tensor == Fp8ExpertWeights::kW3                                      ? layer.w3
                                                                                : layer.w2;
}

}  // namespace

void GpuTransformer::State::allocate_fp8_expert_weights(int64_t capacity) {
  const int64_t D = config.dim, F = config.moe.expert_hidden;
  for (Layer& layer : layers) {
    if (!layer.is_moe) continue;
    Fp8ExpertWeights& c = layer.fp8;
    if (c.capacity != capacity) {
      c = Fp8ExpertWeights{};
      c.capacity = capacity;
      const Fp8ExpertWeightSizes sizes = fp8_expert_weight_sizes(capacity, D, F);  // what the memory plan counts
      c.codes_per_copy = sizes.codes_per_copy;
      c.scales_per_copy = sizes.scales_per_copy;
      c.codes = Buffer<uint8_t>(static_cast<size_t>(2 * Fp8ExpertWeights::kTensors * c.codes_per_copy));
      c.scales = Buffer<float>(static_cast<size_t>(2 * Fp8ExpertWeights::kTensors * c.scales_per_copy));
    }
    c.gate_up_joined = fp8_padded_rows;
    c.version = 0;  // stale
  }
}

Fp8ExpertWeights& GpuTransformer::State::fp8_expert_weights(Layer& layer) {
  Fp8ExpertWeights& c = layer.fp8;
  const uint64_t version = store->weights_version();
  const int64_t first = first_slot(layer), E = local_experts(layer);
  if (c.version == version && c.first_slot == first && c.experts == E) return c;
  // A graph replays what it captured: quantising inside one would quantise at every
  // replay from whatever the weights are then (refresh_fp8_expert_weights runs before).
  MOE_CHECK(!capturing, "fp8 expert weights: stale while a CUDA graph is captured");
  MOE_CHECK(E <= c.capacity, "fp8 expert weights: {} local experts, room for {}", E, c.capacity);
  // Both copies of each in one pass over the bf16 weights.
  auto quantize = [&](int t) {
    quantize_expert_tensor(layer, t, c.code(t, false), c.scale(t, false), c.code(t, true), c.scale(t, true));
  };
  if (c.gate_up_joined) {
    quantize(Fp8ExpertWeights::kGateUp);
  } else {
    quantize(Fp8ExpertWeights::kW1);
    quantize(Fp8ExpertWeights::kW3);
  }
  quantize(Fp8ExpertWeights::kW2);
  c.version = version;
  c.first_slot = first;
  c.experts = E;
  return c;
}

void GpuTransformer::State::quantize_expert_tensor(Layer& layer, int tensor, uint8_t* codes, float* scales,
                                                   uint8_t* codes_t, float* scales_t) {
  const int64_t D = config.dim, F = config.moe.expert_hidden, E = local_experts(layer);
  if (E == 0) return;
  if (tensor != Fp8ExpertWeights::kGateUp) {
    // w1, w3: [E, F, D]; w2: [E, D, F].
    const int64_t N = tensor == Fp8ExpertWeights::kW2 ? D : F, K = tensor == Fp8ExpertWeights::kW2 ? F : D;
    cuda::quantize_weight_blocks(codes, scales, codes_t, scales_t,
                                 local_w(layer, expert_tensor(layer, tensor, gate_up_interleaved)), E, N, K, stream);
    return;
  }
  MOE_CHECK(fp8_padded_rows, "experts: w1 and w3 as one gate|up operand only with rows padded per expert");
  for (int part = 0; part < 2; ++part) {
    const fp8::GateUpPart p = fp8::gate_up_part(part, false, F, D), t = fp8::gate_up_part(part, true, F, D);
    cuda::quantize_weight_blocks(codes ? codes + p.codes_offset : nullptr, scales ? scales + p.scales_offset : nullptr,
                                 codes_t ? codes_t + t.codes_offset : nullptr,
                                 scales_t ? scales_t + t.scales_offset : nullptr,
                                 local_w(layer, part == 0 ? layer.w1 : layer.w3), E, F, D, stream, p.place, t.place);
  }
}

void GpuTransformer::State::refresh_fp8_expert_weights() {
  if (!fp8 || !fp8_weight_cache) return;
  for (Layer& layer : layers)
    if (layer.is_moe) fp8_expert_weights(layer);
}

void GpuTransformer::State::experts_gate_up_swiglu(Layer& layer) {
  const int64_t D = config.dim, F = config.moe.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  const int64_t R = expert_rows(m);
  if (local_experts(layer) == 0) return;
  MOE_CHECK(R * F <= static_cast<int64_t>(m.act_rows->size()), "experts: act rows for {} x {}", R, F);
  padded_expert_gemm_bf16->forward_swiglu(m.gate_up_rows->data(), m.act_rows->data(), m.x_rows->data(), D,
                                          local_w(layer, expert_tensor(layer, Fp8ExpertWeights::kGateUp, true)),
                                          expert_offsets(m), R, F, D, stream);
}

void GpuTransformer::State::experts_down_swiglu_backward(Layer& layer, const MoEBuffers& m, const bf16* dy_rows,
                                                          bf16* act) {
  const int64_t D = config.dim, F = config.moe.expert_hidden;
  padded_expert_gemm_bf16->backward_data_swiglu(dgate_up_rows.data(), act, dy_rows, D,
                                                local_w(layer, expert_tensor(layer, Fp8ExpertWeights::kW2, true)),
                                                m.gate_up_rows->data(), expert_offsets(m), expert_rows(m), F, D, stream);
}

void GpuTransformer::State::expert_forward(Layer& layer, const MoEBuffers& m, int sets, bf16* const* out,
                                           int64_t ld_out, const bf16* x, int64_t ld_x, const int* tensors, int64_t N,
                                           int64_t K, bool x_quantised) {
  const int32_t* offsets = expert_offsets(m);
  MOE_CHECK(sets >= 1 && sets <= cuda::ExpertGemm::kMaxSets, "experts: {} weight sets", sets);
  if (!fp8) {
    const bf16* w[cuda::ExpertGemm::kMaxSets] = {};
    for (int s = 0; s < sets; ++s) w[s] = local_w(layer, expert_tensor(layer, tensors[s], gate_up_interleaved));
    if (padded_expert_gemm_bf16)
      padded_expert_gemm_bf16->forward(sets, out, ld_out, x, ld_x, w, offsets, expert_rows(m), N, K, stream);
    else
      expert_gemm->forward(sets, out, ld_out, x, ld_x, w, offsets, N, K, stream);
    return;
  }
  const int64_t E = local_experts(layer), R = expert_rows(m);
  if (E == 0) return;
  MOE_CHECK(R * K <= static_cast<int64_t>(fp8_rows.size()) && sets <= 2, "fp8 experts: scratch for {} x {} rows", R, K);
  // Padded rows: the scales as one group of all R rows (PaddedExpertGemmFp8's layout).
  if (!x_quantised)
    cuda::quantize_rows_blockwise(fp8_rows.data(), fp8_row_scales.data(), x, ld_x, fp8_padded_rows ? nullptr : offsets,
                                  fp8_padded_rows ? 1 : E, R, K, stream);
  const uint8_t* w_codes[2] = {};
  const float* w_scales[2] = {};
  if (fp8_weight_cache) {
    Fp8ExpertWeights& c = fp8_expert_weights(layer);
    for (int s = 0; s < sets; ++s) {
      w_codes[s] = c.code(tensors[s], false);
      w_scales[s] = c.scale(tensors[s], false);
    }
  } else {
    const int64_t codes = E * N * K, scales = E * fp8::blocks(N) * fp8::blocks(K);
    MOE_CHECK(sets * codes <= static_cast<int64_t>(fp8_weights.size()), "fp8 experts: weight scratch for {} x {}",
              sets, codes);
    for (int s = 0; s < sets; ++s) {
      uint8_t* c = fp8_weights.data() + s * codes;
      float* sc = fp8_weight_scales.data() + s * scales;
      quantize_expert_tensor(layer, tensors[s], c, sc, nullptr, nullptr);
      w_codes[s] = c;
      w_scales[s] = sc;
    }
  }
  if (fp8_padded_rows)
    padded_expert_gemm_fp8->forward(sets, out, ld_out, fp8_rows.data(), fp8_row_scales.data(), w_codes, w_scales,
                                    offsets, R, N, K, stream);
  else
    expert_gemm_fp8->forward(sets, out, ld_out, fp8_rows.data(), fp8_row_scales.data(), w_codes, w_scales, offsets, N,
                             K, stream);
}

void GpuTransformer::State::expert_backward_data(Layer& layer, const MoEBuffers& m, bf16* out, int64_t ld_out,
                                                 const bf16* dy, int64_t ld_dy, int tensor, int64_t N, int64_t K,
                                                 float beta, int dy_quantised_set) {
  const int32_t* offsets = expert_offsets(m);
  if (!fp8) {
    const bf16* w = local_w(layer, expert_tensor(layer, tensor, gate_up_interleaved));
    if (padded_expert_gemm_bf16)
      padded_expert_gemm_bf16->backward_data(out, ld_out, dy, ld_dy, w, offsets, expert_rows(m), N, K, beta, stream);
    else
      expert_gemm->backward_data(out, ld_out, dy, ld_dy, w, offsets, N, K, beta, stream);
    return;
  }
  const int64_t E = local_experts(layer), R = expert_rows(m);
  if (E == 0) return;
  const int64_t set = std::max(dy_quantised_set, 0);
  MOE_CHECK((set + 1) * R * K <= static_cast<int64_t>(fp8_rows.size()), "fp8 experts: scratch for {} x {} rows", R, K);
  const uint8_t* dy_codes = fp8_rows.data() + set * R * K;
  const float* dy_scales = fp8_row_scales.data() + set * R * (K / fp8::kBlock);
  if (dy_quantised_set < 0)
    cuda::quantize_rows_blockwise(fp8_rows.data(), fp8_row_scales.data(), dy, ld_dy, fp8_padded_rows ? nullptr : offsets,
                                  fp8_padded_rows ? 1 : E, R, K, stream);
  // W_e is the Linear weight [K, N] (K outputs, N inputs); the GEMM takes its quantised
  // transpose [N, K]: the cache's transposed copy, or written alone here.
  const uint8_t* wt_codes = fp8_weights.data();
  const float* wt_scales = fp8_weight_scales.data();
  if (fp8_weight_cache) {
    Fp8ExpertWeights& c = fp8_expert_weights(layer);
    wt_codes = c.code(tensor, true);
    wt_scales = c.scale(tensor, true);
  } else {
    MOE_CHECK(N * K * E <= static_cast<int64_t>(fp8_weights.size()), "fp8 experts: weight scratch for {} x {} x {}", E,
              N, K);
    quantize_expert_tensor(layer, tensor, nullptr, nullptr, fp8_weights.data(), fp8_weight_scales.data());
  }
  if (fp8_padded_rows) {
    MOE_CHECK(beta == 0.0f, "padded fp8 experts: a data gradient written, not added (beta {})", beta);
    padded_expert_gemm_fp8->backward_data(out, ld_out, dy_codes, dy_scales, wt_codes, wt_scales, offsets, R, N, K,
                                          stream);
  } else {
    expert_gemm_fp8->backward_data(out, ld_out, dy_codes, dy_scales, wt_codes, wt_scales, offsets, N, K, beta,
                                   stream);
  }
}

void GpuTransformer::State::expert_backward_weight(Layer& layer, const MoEBuffers& m, int sets, const int* tensors,
                                                   const bf16* const* dy, int64_t ld_dy, const bf16* x, int64_t ld_x,
                                                   int64_t N, int64_t K) {
  MOE_CHECK(sets >= 1 && sets <= cuda::ExpertGemm::kMaxSets, "experts: {} weight sets", sets);
  const int32_t* offsets = expert_offsets(m);
  const float beta = overwrite_grads ? 0.0f : 1.0f;  // begin_gradients: written, not added
  if (store->grads_bf16() != nullptr) {
    bf16* dw[cuda::ExpertGemm::kMaxSets] = {};
    for (int s = 0; s < sets; ++s) dw[s] = local_g16(layer, expert_tensor(layer, tensors[s], false));
    if (beta == 0.0f && deepgemm_weight_gradients(layer))
      padded_expert_gemm_bf16->backward_weight(sets, dw, dy, ld_dy, x, ld_x, offsets, expert_rows(m), N, K, stream);
    else
      expert_gemm->backward_weight(sets, dw, dy, ld_dy, x, ld_x, offsets, N, K, stream, beta);
  } else {
    float* dw[cuda::ExpertGemm::kMaxSets] = {};
    for (int s = 0; s < sets; ++s) dw[s] = local_g(layer, expert_tensor(layer, tensors[s], false));
    expert_gemm->backward_weight(sets, dw, dy, ld_dy, x, ld_x, offsets, N, K, stream, beta);
  }
}

bool GpuTransformer::State::deepgemm_weight_gradients(const Layer& layer) const {
  // DeepGEMM's k-grouped kernel beat CUTLASS's at mixtral-mini's 8 experts of ~4,096 rows
  // and lost at olmoe-mini's 64 of ~4,096 (BENCHMARKS.md, "DeepGEMM's bf16 kernel at our
  // expert shapes"; again on 2-CTA clusters, +2.8 ms a step: "The SwiGLU backward's rows
  // split with the math warps").
  return padded_expert_gemm_bf16 && local_experts(layer) <= cuda::PaddedExpertGemmBf16::kWeightGradientExperts;
}

void GpuTransformer::State::experts_backward_fp8_weights(Layer& layer, const MoEBuffers& m, const bf16* dy_rows) {
  const int64_t D = config.dim, F = config.moe.expert_hidden, E = local_experts(layer), R = expert_rows(m);
  const int32_t* offsets = expert_offsets(m);
  const int64_t ld_t = fp8_ld_t, blocks = fp8::blocks(ld_t);
  MOE_CHECK((3 * F + D) * ld_t <= static_cast<int64_t>(fp8_columns.size()) && R + E * (fp8::kBlock - 1) <= ld_t &&
                2 * R * F <= static_cast<int64_t>(fp8_rows.size()),
            "fp8 weight gradients: scratch for {} rows of {} experts", R, E);
  int64_t* P_E1 = fp8_padded_offsets.data();
  cuda::padded_token_offsets(P_E1, offsets, E, stream);
  // Token columns (fp8_token_column_sizes): act, d gate, d up; then dy, later x, in one place.
  auto codes = [&](int64_t feature) { return fp8_columns.data() + feature * ld_t; };
  auto scales = [&](int64_t feature) { return fp8_column_scales.data() + feature * blocks; };
  const float beta = overwrite_grads ? 0.0f : 1.0f;  // begin_gradients: written, not added
  const fp8::ColumnScales b_kind = fp8_column_b_scales;  // x's and act's; dy's, d gate's, d up's per feature
  auto weight_gradient = [&](const Param& p, int64_t dy_feature, int64_t x_feature, int64_t N, int64_t K) {
    if (bf16* g16 = local_g16(layer, p))
      expert_weight_gemm_fp8->run(g16, codes(dy_feature), scales(dy_feature), codes(x_feature), scales(x_feature), ld_t,
                                  P_E1, E, N, K, beta, stream, b_kind);
    else
      expert_weight_gemm_fp8->run(local_g(layer, p), codes(dy_feature), scales(dy_feature), codes(x_feature),
                                  scales(x_feature), ld_t, P_E1, E, N, K, beta, stream, b_kind);
  };
  // SwiGLU's backward: d gate's and d up's row codes (sets 0 and 1 of fp8_rows, for the
  // data gradients) and the token columns of act (from gate|up), d gate and d up.
  cuda::swiglu_backward_fp8_columns(fp8_rows.data(), fp8_row_scales.data(), codes(0), scales(0), ld_t,
                                    dact_rows.data(), m.gate_up_rows->data(), offsets, P_E1, E, R, F, stream, b_kind,
                                    fp8_padded_rows ? fp8::RowScales::OneGroup : fp8::RowScales::PerExpert);
  // dW2_e [D, F] = dy_e^T act_e.
  cuda::quantize_token_columns(codes(3 * F), ld_t, scales(3 * F), dy_rows, D, offsets, P_E1, E, R, D, stream);
  weight_gradient(layer.w2, 3 * F, 0, D, F);
  // dx = d gate @ W1_e + d up @ W3_e from the row codes (one GEMM over K = 2F with padded rows).
  experts_gate_up_backward_data(layer, m, nullptr, true);
  // dW1_e, dW3_e [F, D] = (d gate_e, d up_e)^T x_e.
  cuda::quantize_token_columns(codes(3 * F), ld_t, scales(3 * F), m.x_rows->data(), D, offsets, P_E1, E, R, D, stream,
                               b_kind);
  weight_gradient(layer.w1, F, 3 * F, F, D);
  weight_gradient(layer.w3, 2 * F, 3 * F, F, D);
}

}  // namespace moe
