// `moe bench --kernels`, FP8 half: the experts' GEMMs of one MoE layer through the FP8
// grouped GEMM with blockwise scaling beside the bf16 grouped GEMM (same shapes, balanced
// routing), the quantisation kernels that feed them, the weight gradients in fp8 from token
// columns (training.fp8_weight_gradients) beside the bf16 ones, and the dense FP8 GEMM
// beside cuBLASLt's bf16 one (docs/FP8.md), and the forward and data-gradient GEMMs through
// DeepGEMM's kernel over rows padded per expert beside CUTLASS's. TFLOP/s count the GEMM's
// 2MNK alone (the rows routed, not the padding); the quantisation is listed on its own (in
// training each quantised operand is made once).
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/gpu.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"
#include "kernels/gpu_ops.h"
#include "model/gpu_buffer_sizes.h"
#include "moe/dispatch.h"
#include "moe/gpu_ops.h"
#include "train/cuda/kernel_bench_util.h"

namespace moe {
namespace {

using bench::filled;

// One operand quantised: e4m3 codes and their scales (and, for weights, the transposed copy).
struct Quantised {
  gpu::DeviceArray<uint8_t> codes, codes_t;
  gpu::DeviceArray<float> scales, scales_t;
};

Quantised rows_buffer(int64_t R, int64_t K) {
  return {gpu::DeviceArray<uint8_t>(R * K), {}, gpu::DeviceArray<float>(R * (K / fp8::kBlock)), {}};
}

Quantised weight_buffer(int64_t E, int64_t N, int64_t K) {
  const int64_t S = E * fp8::blocks(N) * fp8::blocks(K);
  return {gpu::DeviceArray<uint8_t>(E * N * K), gpu::DeviceArray<uint8_t>(E * N * K), gpu::DeviceArray<float>(S),
          gpu::DeviceArray<float>(S)};
}

struct GemmRow {
  std::string name;
  double flops, bf16_ms, fp8_ms;
};

struct QuantRow {
  std::string name;
  double bytes, ms;  // bf16 read + e4m3 (and scales) written
};

// The forward and data-gradient GEMMs of `gemms` (in its order) through PaddedExpertGemmFp8
// over the same experts' rows padded to 128 each (DeepGEMM's kernel; its A scales as one
// group), as the step runs them: gate|up's forward and data gradient one GEMM each over
// w1 and w3 as one operand (fp8::gate_up_part); the CUTLASS figures beside them.
std::vector<GemmRow> padded_expert_gemms(const std::vector<GemmRow>& gemms, const std::vector<int32_t>& offsets,
                                         int64_t D, int64_t F, const bf16* w1, const bf16* w3, const Quantised& w2q,
                                         cuda::Stream stream, const bench::TimeFn& median_ms) {
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<int32_t> padded(offsets.size(), 0);
  for (int64_t e = 0; e < E; ++e) {
    const int32_t rows = offsets[static_cast<size_t>(e + 1)] - offsets[static_cast<size_t>(e)];
    padded[static_cast<size_t>(e + 1)] = (padded[static_cast<size_t>(e)] + rows + 127) / 128 * 128;
  }
  const int64_t R = padded.back();
  gpu::DeviceArray<int32_t> padded_d(padded.size());
  padded_d.upload(padded.data(), padded.size());
  const int32_t* off = padded_d.data();
  auto x = filled<bf16>(R * D, 1.0f, 31), act = filled<bf16>(R * F, 1.0f, 32), dy = filled<bf16>(R * D, 1.0f, 33),
       dgate_up = filled<bf16>(R * 2 * F, 1.0f, 34), gate_up = filled<bf16>(R * 2 * F, 0.0f, 35),
       y = filled<bf16>(R * D, 0.0f, 36);
  Quantised xq = rows_buffer(R, D), actq = rows_buffer(R, F), dyq = rows_buffer(R, D), dguq = rows_buffer(R, 2 * F);
  auto rows = [&](Quantised& q, const bf16* in, int64_t ld, int64_t width) {
    cuda::quantize_rows_blockwise(q.codes.data(), q.scales.data(), in, ld, nullptr, 1, R, width, stream);
  };
  rows(xq, x.data(), D, D);
  rows(actq, act.data(), F, F);
  rows(dyq, dy.data(), D, D);
  rows(dguq, dgate_up.data(), 2 * F, 2 * F);
  Quantised w13q = weight_buffer(E, 2 * F, D);
  for (int part = 0; part < 2; ++part) {
    const fp8::GateUpPart p = fp8::gate_up_part(part, false, F, D), t = fp8::gate_up_part(part, true, F, D);
    cuda::quantize_weight_blocks(w13q.codes.data() + p.codes_offset, w13q.scales.data() + p.scales_offset,
                                 w13q.codes_t.data() + t.codes_offset, w13q.scales_t.data() + t.scales_offset,
                                 part == 0 ? w1 : w3, E, F, D, stream, p.place, t.place);
  }
  cuda::PaddedExpertGemmFp8 gemm(E);
  std::vector<GemmRow> out;
  {
    bf16* outs[1] = {gate_up.data()};
    const uint8_t* wq[1] = {w13q.codes.data()};
    const float* wsc[1] = {w13q.scales.data()};
    out.push_back({"fwd gate|up [rows,D]x[D,2F], 1 GEMM", gemms[0].flops, gemms[0].fp8_ms, median_ms([&] {
                     gemm.forward(1, outs, 2 * F, xq.codes.data(), xq.scales.data(), wq, wsc, off, R, 2 * F, D,
                                  stream);
                   })});
  }
  {
    bf16* outs[1] = {y.data()};
    const uint8_t* wq[1] = {w2q.codes.data()};
    const float* wsc[1] = {w2q.scales.data()};
    out.push_back({gemms[1].name, gemms[1].flops, gemms[1].fp8_ms, median_ms([&] {
                     gemm.forward(1, outs, D, actq.codes.data(), actq.scales.data(), wq, wsc, off, R, D, F, stream);
                   })});
  }
  out.push_back({gemms[2].name, gemms[2].flops, gemms[2].fp8_ms, median_ms([&] {
                   gemm.backward_data(act.data(), F, dyq.codes.data(), dyq.scales.data(), w2q.codes_t.data(),
                                      w2q.scales_t.data(), off, R, F, D, stream);
                 })});
  out.push_back({"dgrad gate|up [rows,2F]x[2F,D]", gemms[3].flops, gemms[3].fp8_ms, median_ms([&] {
                   gemm.backward_data(x.data(), D, dguq.codes.data(), dguq.scales.data(), w13q.codes_t.data(),
                                      w13q.scales_t.data(), off, R, D, 2 * F, stream);
                 })});
  return out;
}

}  // namespace

void run_fp8_kernel_bench(const RunConfig& config, std::ostream& out, const bench::TimeFn& median_ms) {
  const ModelConfig& mc = config.model;
  const int64_t T = config.training.micro_batch * mc.seq_len, D = mc.dim, E = mc.moe.n_experts, K = mc.moe.top_k,
                F = mc.moe.expert_hidden;
  if (D % fp8::kBlock != 0 || F % fp8::kBlock != 0) {
    fmt::print(out, "fp8 GEMMs: skipped (dim {} and expert_hidden {} must be multiples of {})\n", D, F, fp8::kBlock);
    return;
  }
  // The routing of kernel_bench.cpp: T * K / E rows per expert, the rest to the last.
  const int64_t R = T * K, per_expert = R / E;
  std::vector<int32_t> offsets(static_cast<size_t>(E + 1));
  for (int64_t e = 0; e <= E; ++e) offsets[static_cast<size_t>(e)] = static_cast<int32_t>(std::min(R, e * per_expert));
  offsets[static_cast<size_t>(E)] = static_cast<int32_t>(R);
  gpu::DeviceArray<int32_t> offsets_d(offsets.size());
  offsets_d.upload(offsets.data(), offsets.size());
  const int32_t* off = offsets_d.data();
  auto x = filled<bf16>(R * D, 1.0f, 1), gate_up = filled<bf16>(R * 2 * F, 1.0f, 2), act = filled<bf16>(R * F, 1.0f, 3),
       y = filled<bf16>(R * D, 1.0f, 4);
  auto w1 = filled<bf16>(E * F * D, 0.02f, 5), w3 = filled<bf16>(E * F * D, 0.02f, 6), w2 = filled<bf16>(E * D * F, 0.02f, 7);
  const cuda::Stream stream = nullptr;

  // Quantisation: the forward's inputs (x, act), the data gradients' (dy of the down
  // projection, dgate and dup), the weights with their transposes.
  Quantised xq = rows_buffer(R, D), actq = rows_buffer(R, F), dyq = rows_buffer(R, D), dgq = rows_buffer(R, F),
            duq = rows_buffer(R, F);
  Quantised w1q = weight_buffer(E, F, D), w3q = weight_buffer(E, F, D), w2q = weight_buffer(E, D, F);
  auto rows = [&](Quantised& q, const bf16* in, int64_t ld, int64_t width) {
    cuda::quantize_rows_blockwise(q.codes.data(), q.scales.data(), in, ld, off, E, R, width, stream);
  };
  auto weight = [&](Quantised& q, const bf16* w, int64_t N, int64_t Kw) {
    cuda::quantize_weight_blocks(q.codes.data(), q.scales.data(), q.codes_t.data(), q.scales_t.data(), w, E, N, Kw,
                                 stream);
  };
  const double row_bytes_D = static_cast<double>(R * D) * 3 + R * D / fp8::kBlock * 4.0,
               row_bytes_F = static_cast<double>(R * F) * 3 + R * F / fp8::kBlock * 4.0,
               weight_bytes = static_cast<double>(E * F * D) * 4;  // bf16 read, codes and transposed codes written
  std::vector<QuantRow> quant;
  quant.push_back({"x [rows,D]", row_bytes_D, median_ms([&] { rows(xq, x.data(), D, D); })});
  quant.push_back({"act [rows,F]", row_bytes_F, median_ms([&] { rows(actq, act.data(), F, F); })});
  quant.push_back({"dy [rows,D]", row_bytes_D, median_ms([&] { rows(dyq, y.data(), D, D); })});
  quant.push_back({"dgate, dup 2x[rows,F] (ld 2F)", 2 * row_bytes_F, median_ms([&] {
                     rows(dgq, gate_up.data(), 2 * F, F);
                     rows(duq, gate_up.data() + F, 2 * F, F);
                   })});
  // SwiGLU writing act and its codes (the forward's fused kernel), against SwiGLU alone
  // (the bf16 path's) plus act's quantisation: gate|up read, act, codes and scales written.
  const double swiglu_bytes = static_cast<double>(R * F) * (4 + 2 + 1) + R * F / fp8::kBlock * 4.0;
  quant.push_back({"swiglu + act codes (fused)", swiglu_bytes, median_ms([&] {
                     cuda::swiglu_forward_fp8(act.data(), actq.codes.data(), actq.scales.data(), gate_up.data(), off, E,
                                              R, F, stream);
                   })});
  quant.push_back({"swiglu alone (bf16 act)", static_cast<double>(R * F) * 6,
                   median_ms([&] { cuda::swiglu_forward(act.data(), gate_up.data(), R, F, stream); })});
  // SwiGLU's backward writing d gate | d up and both their codes (the fused kernel), against
  // it alone (the bf16 path's; the fp8 path then quantises both, the row above).
  Quantised dguq = rows_buffer(2 * R, F);
  auto dgate_up = filled<bf16>(R * 2 * F, 1.0f, 9);
  quant.push_back({"swiglu bwd + dgate,dup codes (fused)",
                   static_cast<double>(R * F) * (6 + 4 + 2) + 2 * R * F / fp8::kBlock * 4.0, median_ms([&] {
                     cuda::swiglu_backward_fp8(dgate_up.data(), dguq.codes.data(), dguq.scales.data(), act.data(),
                                               gate_up.data(), off, E, R, F, stream);
                   })});
  quant.push_back({"swiglu bwd alone (bf16)", static_cast<double>(R * F) * 10, median_ms([&] {
                     cuda::swiglu_backward(dgate_up.data(), act.data(), gate_up.data(), R, F, stream);
                   })});
  // The dispatch's permute and the combine's backward writing their rows' codes too (the
  // local dispatcher's fp8 path), against them alone (the plain path then quantises the
  // rows: the "x" and "dy" lines above). Their own routing: slot k of token t to expert
  // (7 t + k E / K) mod E, dropless, so rows scatter as a router's do.
  std::vector<int32_t> expert_TK(static_cast<size_t>(R)), row_TK(static_cast<size_t>(R)),
      counts_E(static_cast<size_t>(E)), routed_offsets(static_cast<size_t>(E + 1)), token_R(static_cast<size_t>(R));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k)
      expert_TK[static_cast<size_t>(t * K + k)] = static_cast<int32_t>((7 * t + k * (E / K)) % E);
  assign_rows(row_TK.data(), counts_E.data(), routed_offsets.data(), token_R.data(), expert_TK.data(), T, E, K,
              /*capacity=*/R);
  gpu::DeviceArray<int32_t> row_d(row_TK.size()), routed_offsets_d(routed_offsets.size());
  row_d.upload(row_TK.data(), row_TK.size());
  routed_offsets_d.upload(routed_offsets.data(), routed_offsets.size());
  auto tokens_TD = filled<bf16>(T * D, 1.0f, 10);
  auto weight_TK = filled<float>(R, 0.5f, 11), dweight_TK = filled<float>(R, 0.0f, 12);
  auto dy_rows = filled<bf16>(R * D, 0.0f, 13);
  const cuda::RowCodes x_codes{xq.codes.data(), xq.scales.data(), routed_offsets_d.data(), E, R},
      dy_codes{dyq.codes.data(), dyq.scales.data(), routed_offsets_d.data(), E, R};
  const double permute_bytes = static_cast<double>(T * D) * 2 + static_cast<double>(R * D) * 2,
               combine_bytes = static_cast<double>(T * D) * 2 + static_cast<double>(R * D) * 4,
               codes_bytes = static_cast<double>(R * D) + R * D / fp8::kBlock * 4.0;
  quant.push_back({"permute + x codes (fused)", permute_bytes + codes_bytes, median_ms([&] {
                     cuda::permute_forward_by_token_fp8(x.data(), x_codes, tokens_TD.data(), row_d.data(), T, K, D,
                                                        stream);
                   })});
  quant.push_back({"permute alone (bf16)", permute_bytes, median_ms([&] {
                     cuda::permute_forward_by_token(x.data(), tokens_TD.data(), row_d.data(), T, K, D, stream);
                   })});
  quant.push_back({"combine bwd + dy codes (fused)", combine_bytes + codes_bytes, median_ms([&] {
                     cuda::combine_backward_fp8(dy_rows.data(), dy_codes, dweight_TK.data(), tokens_TD.data(), y.data(),
                                                weight_TK.data(), row_d.data(), T, K, D, stream);
                   })});
  quant.push_back({"combine bwd alone (bf16)", combine_bytes, median_ms([&] {
                     cuda::combine_backward(dy_rows.data(), dweight_TK.data(), tokens_TD.data(), y.data(), weight_TK.data(),
                                            row_d.data(), T, K, D, stream);
                   })});
  // The norm before the q|k|v projection and RoPE's backward after attention's, writing
  // their rows' codes (n1 [T, D], dq|dk|dv [T, (H + 2G) d]) against them alone (the
  // projection then quantises the rows itself).
  {
    const int64_t H = mc.n_heads, G = mc.n_kv_heads, hd = mc.head_dim(), N = mc.qkv_width();
    auto n1 = filled<bf16>(T * D, 1.0f, 14), norm_w = filled<bf16>(D, 1.0f, 15), dqkv = filled<bf16>(T * N, 1.0f, 16);
    auto rstd = filled<float>(T, 0.0f, 17);
    gpu::DeviceArray<uint8_t> codes(static_cast<size_t>(T * std::max(D, N)));
    gpu::DeviceArray<float> scales(static_cast<size_t>(T * std::max(D, N) / fp8::kBlock));
    std::vector<int32_t> positions(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) positions[static_cast<size_t>(t)] = static_cast<int32_t>(t % mc.seq_len);
    gpu::DeviceArray<int32_t> positions_d(positions.size());
    positions_d.upload(positions.data(), positions.size());
    gpu::DeviceArray<float> table(static_cast<size_t>(mc.seq_len * hd));
    cuda::rope_table(table.data(), mc.seq_len, hd, static_cast<float>(mc.rope_theta), stream);
    const cuda::RowCodes n1_codes{codes.data(), scales.data(), nullptr, 1, T};
    const double norm_bytes = static_cast<double>(T * D) * 4, rope_bytes = static_cast<double>(T * (H + G) * hd) * 4,
                 n1_codes_bytes = static_cast<double>(T * D) * (1 + 4.0 / fp8::kBlock),
                 qkv_codes_bytes = static_cast<double>(T * N) * (1 + 4.0 / fp8::kBlock);
    quant.push_back({"rmsnorm + n1 codes (fused)", norm_bytes + n1_codes_bytes, median_ms([&] {
                       cuda::rmsnorm_forward_fp8(n1.data(), n1_codes, rstd.data(), nullptr, tokens_TD.data(), nullptr,
                                                 norm_w.data(), T, D, 1e-5f, stream);
                     })});
    quant.push_back({"rmsnorm alone", norm_bytes, median_ms([&] {
                       cuda::rmsnorm_forward(n1.data(), rstd.data(), nullptr, tokens_TD.data(), nullptr, norm_w.data(),
                                             T, D, 1e-5f, stream);
                     })});
    quant.push_back({"n1 [T,D]", static_cast<double>(T * D) * 2 + n1_codes_bytes, median_ms([&] {
                       cuda::quantize_rows_blockwise(codes.data(), scales.data(), n1.data(), D, nullptr, 1, T, D,
                                                     stream);
                     })});
    const cuda::RowCodes qkv_codes{codes.data(), scales.data(), nullptr, 1, T};
    quant.push_back({"rope bwd + dq|dk|dv codes (fused)",
                     rope_bytes + static_cast<double>(T * G * hd) * 2 + qkv_codes_bytes, median_ms([&] {
                       cuda::rope_backward_fp8(dqkv.data(), qkv_codes, positions_d.data(), table.data(), T, H + G,
                                               H + 2 * G, hd, stream);
                     })});
    quant.push_back({"rope bwd alone", rope_bytes, median_ms([&] {
                       cuda::rope_backward(dqkv.data(), positions_d.data(), table.data(), T, H + G, hd, stream, N);
                     })});
    quant.push_back({"dq|dk|dv [T,(H+2G)d]", static_cast<double>(T * N) * 2 + qkv_codes_bytes, median_ms([&] {
                       cuda::quantize_rows_blockwise(codes.data(), scales.data(), dqkv.data(), N, nullptr, 1, T, N,
                                                     stream);
                     })});
  }
  quant.push_back({"w1, w3, w2 + transposes", 3 * weight_bytes, median_ms([&] {
                     weight(w1q, w1.data(), F, D);
                     weight(w3q, w3.data(), F, D);
                     weight(w2q, w2.data(), D, F);
                   })});

  cuda::ExpertGemm bf16_gemm(E);
  cuda::ExpertGemmFp8 fp8_gemm(E);
  const double mnk = 2.0 * static_cast<double>(R) * static_cast<double>(D) * static_cast<double>(F);
  std::vector<GemmRow> gemms;
  {
    bf16* outs[2] = {gate_up.data(), gate_up.data() + F};
    const bf16* ws[2] = {w1.data(), w3.data()};
    const uint8_t* wq[2] = {w1q.codes.data(), w3q.codes.data()};
    const float* wsc[2] = {w1q.scales.data(), w3q.scales.data()};
    gemms.push_back({"fwd gate|up  [rows,D]x[D,2F]", 2 * mnk,
                     median_ms([&] { bf16_gemm.forward(2, outs, 2 * F, x.data(), D, ws, off, F, D, stream); }),
                     median_ms([&] {
                       fp8_gemm.forward(2, outs, 2 * F, xq.codes.data(), xq.scales.data(), wq, wsc, off, F, D, stream);
                     })});
  }
  {
    bf16* outs[1] = {y.data()};
    const bf16* ws[1] = {w2.data()};
    const uint8_t* wq[1] = {w2q.codes.data()};
    const float* wsc[1] = {w2q.scales.data()};
    gemms.push_back({"fwd down     [rows,F]x[F,D]", mnk,
                     median_ms([&] { bf16_gemm.forward(1, outs, D, act.data(), F, ws, off, D, F, stream); }),
                     median_ms([&] {
                       fp8_gemm.forward(1, outs, D, actq.codes.data(), actq.scales.data(), wq, wsc, off, D, F, stream);
                     })});
  }
  gemms.push_back({"dgrad down   [rows,D]x[D,F]", mnk,
                   median_ms([&] { bf16_gemm.backward_data(act.data(), F, y.data(), D, w2.data(), off, F, D, 0, stream); }),
                   median_ms([&] {
                     fp8_gemm.backward_data(act.data(), F, dyq.codes.data(), dyq.scales.data(), w2q.codes_t.data(),
                                            w2q.scales_t.data(), off, F, D, 0, stream);
                   })});
  gemms.push_back({"dgrad gate+up 2x[rows,F]x[F,D]", 2 * mnk, median_ms([&] {
                     bf16_gemm.backward_data(x.data(), D, gate_up.data(), 2 * F, w1.data(), off, D, F, 0, stream);
                     bf16_gemm.backward_data(x.data(), D, gate_up.data() + F, 2 * F, w3.data(), off, D, F, 1, stream);
                   }),
                   median_ms([&] {
                     fp8_gemm.backward_data(x.data(), D, dgq.codes.data(), dgq.scales.data(), w1q.codes_t.data(),
                                            w1q.scales_t.data(), off, D, F, 0, stream);
                     fp8_gemm.backward_data(x.data(), D, duq.codes.data(), duq.scales.data(), w3q.codes_t.data(),
                                            w3q.scales_t.data(), off, D, F, 1, stream);
                   })});

  // Weight gradients (fp32 gradients, beta 0): bf16 grouped GEMMs over the rows, against
  // fp8 over token columns (training.fp8_weight_gradients) and the kernels that make them.
  const Fp8TokenColumnSizes columns = fp8_token_column_sizes(R, E, D, F);
  const int64_t ld_t = columns.ld_t, blocks = fp8::blocks(ld_t);
  gpu::DeviceArray<int64_t> padded(static_cast<size_t>(E + 1));
  cuda::padded_token_offsets(padded.data(), off, E, stream);
  gpu::DeviceArray<uint8_t> x_t(D * ld_t), dy_t(D * ld_t), swiglu_t(3 * F * ld_t);
  gpu::DeviceArray<float> x_ts(D * blocks), dy_ts(D * blocks), swiglu_ts(3 * F * blocks);
  // training.fp8_weight_gradient_scales = 128x128: x's and act's columns with block scales.
  gpu::DeviceArray<uint8_t> x_tb(D * ld_t), swiglu_tb(3 * F * ld_t);
  gpu::DeviceArray<float> x_tbs(D * blocks), swiglu_tbs(3 * F * blocks);
  std::vector<QuantRow> column_quant;
  const double column_bytes_D = static_cast<double>(R * D) * 3 + D * blocks * 4.0;
  column_quant.push_back({"x token columns [D,tokens]", column_bytes_D, median_ms([&] {
                            cuda::quantize_token_columns(x_t.data(), ld_t, x_ts.data(), x.data(), D, off, padded.data(),
                                                         E, R, D, stream);
                          })});
  column_quant.push_back({"x token columns, 128x128 scales", column_bytes_D, median_ms([&] {
                            cuda::quantize_token_columns(x_tb.data(), ld_t, x_tbs.data(), x.data(), D, off,
                                                         padded.data(), E, R, D, stream, fp8::ColumnScales::Block);
                          })});
  cuda::quantize_token_columns(dy_t.data(), ld_t, dy_ts.data(), y.data(), D, off, padded.data(), E, R, D, stream);
  column_quant.push_back({"swiglu bwd to columns (fused)",
                          static_cast<double>(R * F) * (6 + 2 + 3) + 5 * R * F / fp8::kBlock * 4.0, median_ms([&] {
                            cuda::swiglu_backward_fp8_columns(dguq.codes.data(), dguq.scales.data(), swiglu_t.data(),
                                                              swiglu_ts.data(), ld_t, act.data(), gate_up.data(), off,
                                                              padded.data(), E, R, F, stream);
                          })});
  column_quant.push_back({"swiglu bwd to columns, act 128x128",
                          static_cast<double>(R * F) * (6 + 2 + 3) + 5 * R * F / fp8::kBlock * 4.0, median_ms([&] {
                            cuda::swiglu_backward_fp8_columns(dguq.codes.data(), dguq.scales.data(), swiglu_tb.data(),
                                                              swiglu_tbs.data(), ld_t, act.data(), gate_up.data(), off,
                                                              padded.data(), E, R, F, stream, fp8::ColumnScales::Block);
                          })});
  cuda::ExpertWeightGemmFp8 fp8_weight_gemm(E);
  gpu::DeviceArray<float> dw1(E * F * D), dw3(E * F * D), dw2(E * D * F);
  std::vector<GemmRow> weight_gemms;
  {
    float* dw[1] = {dw2.data()};
    const bf16* dys[1] = {y.data()};
    weight_gemms.push_back(
        {"wgrad down   [D,rows]x[rows,F]", mnk, median_ms([&] {
           bf16_gemm.backward_weight(1, dw, dys, D, act.data(), F, off, D, F, stream, 0.0f);
         }),
         median_ms([&] {
           fp8_weight_gemm.run(dw2.data(), dy_t.data(), dy_ts.data(), swiglu_t.data(), swiglu_ts.data(), ld_t,
                               padded.data(), E, D, F, 0.0f, stream);
         })});
  }
  {
    float* dw[2] = {dw1.data(), dw3.data()};
    const bf16* dgu[2] = {gate_up.data(), gate_up.data() + F};
    weight_gemms.push_back(
        {"wgrad gate+up 2x[F,rows]x[rows,D]", 2 * mnk, median_ms([&] {
           bf16_gemm.backward_weight(2, dw, dgu, 2 * F, x.data(), D, off, F, D, stream, 0.0f);
         }),
         median_ms([&] {
           for (int s = 0; s < 2; ++s)
             fp8_weight_gemm.run(s == 0 ? dw1.data() : dw3.data(), swiglu_t.data() + (1 + s) * F * ld_t,
                                 swiglu_ts.data() + (1 + s) * F * blocks, x_t.data(), x_ts.data(), ld_t, padded.data(),
                                 E, F, D, 0.0f, stream);
         })});
  }
  // training.fp8_weight_gradient_scales = 128x128: the same GEMMs with B's columns
  // block-scaled (the bf16 times repeated beside them).
  std::vector<GemmRow> block_weight_gemms;
  block_weight_gemms.push_back({"wgrad down, act 128x128", mnk, weight_gemms[0].bf16_ms, median_ms([&] {
                                  fp8_weight_gemm.run(dw2.data(), dy_t.data(), dy_ts.data(), swiglu_tb.data(),
                                                      swiglu_tbs.data(), ld_t, padded.data(), E, D, F, 0.0f, stream,
                                                      fp8::ColumnScales::Block);
                                })});
  block_weight_gemms.push_back({"wgrad gate+up, x 128x128", 2 * mnk, weight_gemms[1].bf16_ms, median_ms([&] {
                                  for (int s = 0; s < 2; ++s)
                                    fp8_weight_gemm.run(s == 0 ? dw1.data() : dw3.data(),
                                                        swiglu_t.data() + (1 + s) * F * ld_t,
                                                        swiglu_ts.data() + (1 + s) * F * blocks, x_tb.data(),
                                                        x_tbs.data(), ld_t, padded.data(), E, F, D, 0.0f, stream,
                                                        fp8::ColumnScales::Block);
                                })});

  // Dense: the [rows, D] x [D, F] ceiling of kernel_bench.cpp and a [T, D] x [D, D]
  // projection, cuBLASLt bf16 against the FP8 GEMM (its A quantised as one group).
  cuda::Blas blas;
  cuda::DenseGemmFp8 dense;
  std::vector<GemmRow> dense_rows;
  if (R % 4 == 0 && T % 4 == 0) {
    Quantised x_all = rows_buffer(R, D), x_proj = rows_buffer(T, D), proj = weight_buffer(1, D, D);
    auto wp = filled<bf16>(D * D, 0.02f, 8);
    cuda::quantize_rows_blockwise(x_all.codes.data(), x_all.scales.data(), x.data(), D, nullptr, 1, R, D, stream);
    cuda::quantize_rows_blockwise(x_proj.codes.data(), x_proj.scales.data(), x.data(), D, nullptr, 1, T, D, stream);
    cuda::quantize_weight_blocks(proj.codes.data(), proj.scales.data(), nullptr, nullptr, wp.data(), 1, D, D, stream);
    dense_rows.push_back(
        {fmt::format("[{},{}]x[{},{}] ceiling", R, D, D, F), mnk, median_ms([&] {
           blas.gemm(false, true, R, F, D, 1, x.data(), D, w1.data(), D, 0, act.data(), false, F, stream);
         }),
         median_ms([&] {
           // w1's first expert [F, D] and its scales (E = 1 has the same layout).
           dense.gemm(act.data(), F, x_all.codes.data(), x_all.scales.data(), w1q.codes.data(), w1q.scales.data(), R,
                      F, D, 0, stream);
         })});
    dense_rows.push_back(
        {fmt::format("[{},{}]x[{},{}] projection", T, D, D, D), 2.0 * T * D * D, median_ms([&] {
           blas.gemm(false, true, T, D, D, 1, x.data(), D, wp.data(), D, 0, y.data(), false, D, stream);
         }),
         median_ms([&] {
           dense.gemm(y.data(), D, x_proj.codes.data(), x_proj.scales.data(), proj.codes.data(), proj.scales.data(), T,
                      D, D, 0, stream);
         })});
  }
  MOE_CUDA_CHECK(cudaDeviceSynchronize());

  fmt::print(out, "fp8 (e4m3, 1x128 activation and 128x128 weight scales) against bf16, same shapes:\n");
  fmt::print(out, "  {:<36} {:>9} {:>8}   {:>9} {:>8}   {:>7}\n", "kernel", "bf16", "TFLOP/s", "fp8", "TFLOP/s",
             "speedup");
  double bf16_total = 0, fp8_total = 0, flops_total = 0;
  auto print_gemm = [&](const GemmRow& row) {
    fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f}   {:7.3f}ms {:8.0f}   {:6.2f}x\n", row.name, row.bf16_ms,
               row.flops / row.bf16_ms / 1e9, row.fp8_ms, row.flops / row.fp8_ms / 1e9, row.bf16_ms / row.fp8_ms);
  };
  for (const GemmRow& row : gemms) {
    print_gemm(row);
    bf16_total += row.bf16_ms;
    fp8_total += row.fp8_ms;
    flops_total += row.flops;
  }
  print_gemm({"expert fwd + dgrad GEMMs of the layer", flops_total, bf16_total, fp8_total});
  double bf16_weight_total = 0, fp8_weight_total = 0, weight_flops = 0;
  for (const GemmRow& row : weight_gemms) {
    print_gemm(row);
    bf16_weight_total += row.bf16_ms;
    fp8_weight_total += row.fp8_ms;
    weight_flops += row.flops;
  }
  print_gemm({"expert weight-gradient GEMMs", weight_flops, bf16_weight_total, fp8_weight_total});
  double fp8_block_total = 0;
  for (const GemmRow& row : block_weight_gemms) {
    print_gemm(row);
    fp8_block_total += row.fp8_ms;
  }
  print_gemm({"weight-gradient GEMMs, B 128x128", weight_flops, bf16_weight_total, fp8_block_total});
  for (const GemmRow& row : dense_rows) print_gemm({"dense " + row.name, row.flops, row.bf16_ms, row.fp8_ms});
  if (cuda::deepgemm_available() && E <= cuda::PaddedExpertGemmFp8::kMaxExperts) {
    const std::vector<GemmRow> padded = padded_expert_gemms(gemms, offsets, D, F, w1.data(), w3.data(), w2q, stream, median_ms);
    fmt::print(out, "  the same fwd and dgrad GEMMs over rows padded per expert to 128, DeepGEMM's kernel:\n");
    fmt::print(out, "  {:<36} {:>9} {:>8}   {:>9} {:>8}   {:>7}\n", "kernel", "CUTLASS", "TFLOP/s", "DeepGEMM",
               "TFLOP/s", "speedup");
    double cutlass_total = 0, deepgemm_total = 0;
    for (const GemmRow& row : padded) {
      print_gemm(row);
      cutlass_total += row.bf16_ms;
      deepgemm_total += row.fp8_ms;
    }
    print_gemm({"expert fwd + dgrad GEMMs of the layer", flops_total, cutlass_total, deepgemm_total});
  }
  // The step's quantisation: the rows' kernels but act's (the fused SwiGLU's extra time over
  // SwiGLU alone instead), and the weights.
  double quant_total = 0, weights_ms = 0;
  fmt::print(out, "  quantisation kernels (bf16 in, e4m3 + fp32 scales out):\n");
  for (size_t i = 0; i < quant.size(); ++i) {
    const QuantRow& row = quant[i];
    fmt::print(out, "    {:<34} {:7.3f}ms {:6.0f} GB/s\n", row.name, row.ms, row.bytes / row.ms / 1e6);
    if (row.name == "act [rows,F]") continue;
    quant_total += row.name == "swiglu alone (bf16 act)" ? -row.ms : row.ms;
  }
  weights_ms = quant.back().ms;
  fmt::print(out, "  token columns for the fp8 weight gradients ({} padded tokens):\n", ld_t);
  for (const QuantRow& row : column_quant)
    fmt::print(out, "    {:<34} {:7.3f}ms {:6.0f} GB/s\n", row.name, row.ms, row.bytes / row.ms / 1e6);
  // training.fp8_weight_cache quantises the weights (both copies) once per optimizer step:
  // once in a step of one micro-batch, not at all in the later micro-batches of a step.
  fmt::print(out, "  fp8 expert GEMMs + all their quantisation: {:.3f} ms against bf16 {:.3f} ms ({:.2f}x)\n",
             fp8_total + quant_total, bf16_total, bf16_total / (fp8_total + quant_total));
  fmt::print(out, "  the same without the weights (a later micro-batch of a step): {:.3f} ms ({:.2f}x)\n",
             fp8_total + quant_total - weights_ms, bf16_total / (fp8_total + quant_total - weights_ms));
}

}  // namespace moe
