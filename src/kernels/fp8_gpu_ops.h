// The FP8 GEMMs with fine-grained scaling (Hopper, CUTLASS's blockwise-scaled wgmma
// kernels) and the quantisation kernels that feed them (docs/FP8.md). Formats and scale
// layouts: kernels/fp8_blockwise.h, whose CPU functions the quantisation kernels match
// bit for bit. Declared without CUDA headers; `stream` is a cudaStream_t.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/fp8_blockwise.h"
#include "kernels/gpu_ops.h"

namespace moe::cuda {

// Activation rows x [R, K] (row stride ld_x, a multiple of 4) -> e4m3 codes [R, K] and
// one power-of-two scale per row and 128 columns, grouped by the device offsets_E1 (E + 1
// values; null: one group of all R rows) as fp8::activation_scale_index says; rows at or
// past offsets[E] are not written. K a multiple of 128.
void quantize_rows_blockwise(uint8_t* codes_RK, float* scales, const bf16* x, int64_t ld_x,
                             const int32_t* offsets_E1, int64_t E, int64_t R, int64_t K, Stream stream);

// Kernels that write bf16 rows can write their e4m3 codes [R, K] and 1 x 128 tile scales
// beside them, exactly what quantize_rows_blockwise(codes_RK, scales, rows, K, offsets_E1,
// E, R, K) gives of those rows afterwards, saving the GEMM that reads them that pass.
struct RowCodes {
  uint8_t* codes_RK = nullptr;  // 8-byte aligned
  float* scales = nullptr;
  const int32_t* offsets_E1 = nullptr;  // the rows' groups (experts); null: one group of R rows
  int64_t E = 1, R = 0;
};

// rmsnorm_forward (kernels/gpu_ops.h, bit for bit) and y's codes (one group: codes.R = T,
// no offsets), in one kernel where its vector path runs, else the two. D a multiple of 128.
void rmsnorm_forward_fp8(bf16* y_TD, const RowCodes& codes, float* rstd_T, bf16* residual_out_TD, const bf16* x_TD,
                         const ResidualBranch& branch, const bf16* w_D, int64_t T, int64_t D, float eps,
                         Stream stream);
// rope_backward on the first N_rope heads of the rows [T, N_all d] and the codes of the
// whole rows afterwards (one group: codes.R = T), the heads past N_rope as they are (dv of
// a fused q|k|v gradient): one kernel for d = 128 (a head is one tile), else the two.
void rope_backward_fp8(bf16* dx_TNd, const RowCodes& codes, const int32_t* positions_T, const float* cos_sin_Sh2,
                       int64_t T, int64_t N_rope, int64_t N_all, int64_t d, Stream stream);

// SwiGLU with its output quantised as above: act [R, F] = silu(gate) * up of gate|up
// [R, 2F] (swiglu_forward's values, bit for bit; written unless act_RF is null) and the
// codes and scales quantize_rows_blockwise would make of that act (rows below
// offsets_E1[E] only). F a multiple of 128; gate|up and act 16-byte aligned.
void swiglu_forward_fp8(bf16* act_RF, uint8_t* codes_RF, float* scales, const bf16* gate_up_RF2,
                        const int32_t* offsets_E1, int64_t E, int64_t R, int64_t F, Stream stream);

// SwiGLU's backward with both outputs quantised as above: d gate | d up [R, 2F] of d act
// [R, F] and gate|up [R, 2F] (swiglu_backward's values, bit for bit, every row), and for
// rows below offsets_E1[E] d gate's codes [R, F] and scales (R x F / 128) followed by d up's
// (codes_2RF + R * F, scales_2 + R * F / 128): quantize_rows_blockwise's of each. With no
// offsets (one group: rows padded per expert) d gate | d up as one [R, 2F] operand instead:
// the codes and scales quantize_rows_blockwise gives for the bf16 d gate | d up whole (the
// data gradient as one GEMM over K = 2F). F a multiple of 128; the bf16 buffers 16-byte
// aligned.
void swiglu_backward_fp8(bf16* dgate_up_RF2, uint8_t* codes_2RF, float* scales_2, const bf16* dact_RF,
                         const bf16* gate_up_RF2, const int32_t* offsets_E1, int64_t E, int64_t R, int64_t F,
                         Stream stream);

// The weight gradients' operands (fp8::quantize_token_columns, bit for bit): P_E1 (E + 1
// device int64) the padded token offsets of offsets_E1; then x [R, W] (row stride ld_x)
// transposed per expert into codes_t [W, ld_t] and scales (ld_t >= R + 127 E, a multiple of
// 16; W a multiple of 8). Nothing is read back on the host. kind Block: one scale per 128
// features and 128 tokens (the weight GEMMs' B side, docs/FP8.md "Still to do").
void padded_token_offsets(int64_t* P_E1, const int32_t* offsets_E1, int64_t E, Stream stream);
void quantize_token_columns(uint8_t* codes_t_WP, int64_t ld_t, float* scales_t, const bf16* x, int64_t ld_x,
                            const int32_t* offsets_E1, const int64_t* P_E1, int64_t E, int64_t R, int64_t W,
                            Stream stream, fp8::ColumnScales kind = fp8::ColumnScales::PerFeature);

// SwiGLU's backward for the fp8 weight gradients, one pass over d act and gate|up: d gate's
// and d up's codes and scales as swiglu_backward_fp8 writes them (no bf16 output: the fp8
// GEMMs read only the codes), and the token columns (quantize_token_columns, W = F, scales
// F x blocks(ld_t) each) of act (swiglu_forward's values), d gate and d up, in that order
// from columns_3FP (F x ld_t codes each) and column_scales_3. P_E1: padded_token_offsets.
// act_kind Block: act's columns (the weight GEMM's B) with one scale per 128 x 128 tile, in
// act's part of column_scales_3; d gate's and d up's stay per feature. row_scales OneGroup:
// the row codes as swiglu_backward_fp8 with no offsets lays them out (d gate | d up one
// [R, 2F] operand of one group of R rows: rows padded per expert).
void swiglu_backward_fp8_columns(uint8_t* codes_2RF, float* scales_2, uint8_t* columns_3FP, float* column_scales_3,
                                 int64_t ld_t, const bf16* dact_RF, const bf16* gate_up_RF2, const int32_t* offsets_E1,
                                 const int64_t* P_E1, int64_t E, int64_t R, int64_t F, Stream stream,
                                 fp8::ColumnScales act_kind = fp8::ColumnScales::PerFeature,
                                 fp8::RowScales row_scales = fp8::RowScales::PerExpert);

// The experts' weight gradients in fp8 (fp8::weight_gradient_token_columns on the device):
// dw_e [M, N] = beta * dw_e + sum over expert e's padded tokens of a [M, ld_t] x b [N, ld_t]
// token columns (quantize_token_columns of dy and of x), P_E1 their padded offsets
// (device); beta 0 zeroes experts without tokens. fp32 or bf16 gradients.
class ExpertWeightGemmFp8 {
 public:
  explicit ExpertWeightGemmFp8(int64_t max_experts);
  ~ExpertWeightGemmFp8();
  ExpertWeightGemmFp8(const ExpertWeightGemmFp8&) = delete;
  ExpertWeightGemmFp8& operator=(const ExpertWeightGemmFp8&) = delete;
  // b_kind: b's scales per feature or per 128 x 128 block (fp8::ColumnScales); a's per feature.
  void run(float* dw_EMN, const uint8_t* a_t, const float* a_scales, const uint8_t* b_t, const float* b_scales,
           int64_t ld_t, const int64_t* P_E1, int64_t E, int64_t M, int64_t N, float beta, Stream stream,
           fp8::ColumnScales b_kind = fp8::ColumnScales::PerFeature);
  void run(bf16* dw_EMN, const uint8_t* a_t, const float* a_scales, const uint8_t* b_t, const float* b_scales,
           int64_t ld_t, const int64_t* P_E1, int64_t E, int64_t M, int64_t N, float beta, Stream stream,
           fp8::ColumnScales b_kind = fp8::ColumnScales::PerFeature);
  void set_sm_limit(int sms);  // as ExpertGemm's

 private:
  struct State;
  State* state_;
};

// Weights w [E, N, K] -> codes [E, N, K] with scales [E][KB][NB], and their transpose
// codes_t [E, K, N] with scales_t [E][NB][KB] (the B operand of dy @ W); either pair may
// be null, not both; each packed or where `place` / `place_t` puts it (W1 and W3 as one
// gate|up operand: fp8::gate_up_part). One power-of-two scale per 128 x 128 block.
void quantize_weight_blocks(uint8_t* codes_ENK, float* scales, uint8_t* codes_t_EKN, float* scales_t,
                            const bf16* w_ENK, int64_t E, int64_t N, int64_t K, Stream stream,
                            fp8::WeightBlocksPlace place = {}, fp8::WeightBlocksPlace place_t = {});

// The experts' FP8 GEMMs over the device row layout (as ExpertGemm: expert e owns rows
// [offsets_E1[e], offsets_E1[e + 1]), read on the device, no host synchronisation; empty
// experts cost nothing). Operands are quantised by the functions above; the scales are
// applied inside the GEMM (fp32 accumulation per 128-deep slice, then scaled and summed),
// the output is bf16. K must be a multiple of 128, N and ld_out multiples of 8.
class ExpertGemmFp8 {
 public:
  explicit ExpertGemmFp8(int64_t max_experts);
  ~ExpertGemmFp8();
  ExpertGemmFp8(const ExpertGemmFp8&) = delete;
  ExpertGemmFp8& operator=(const ExpertGemmFp8&) = delete;
  static constexpr int kMaxSets = 2;
  // out[s] rows of e ([rows_e, N], ld_out) = x rows of e @ W_e^T, x from
  // quantize_rows_blockwise over offsets_E1 ([R, K] codes, their scales), W = set s's
  // quantize_weight_blocks codes [E, N, K] and scales.
  void forward(int sets, bf16* const* out, int64_t ld_out, const uint8_t* x_codes, const float* x_scales,
               const uint8_t* const* w_codes, const float* const* w_scales, const int32_t* offsets_E1, int64_t N,
               int64_t K, Stream stream);
  // out rows of e ([rows_e, N], ld_out) = dy rows of e ([rows_e, K]) @ W_e + beta * out,
  // with W_e [K, N] given as its quantised transpose (quantize_weight_blocks' codes_t
  // [E, N, K] and scales_t of the [E, K, N] weight).
  void backward_data(bf16* out, int64_t ld_out, const uint8_t* dy_codes, const float* dy_scales,
                     const uint8_t* wt_codes, const float* wt_scales, const int32_t* offsets_E1, int64_t N, int64_t K,
                     float beta, Stream stream);
  // As ExpertGemm's.
  void set_sm_limit(int sms);
  void set_experts(int64_t n_experts);

 private:
  struct State;
  State* state_;
};

// DeepGEMM's Hopper fp8 GEMM (training.fp8_gemm_backend = deepgemm; kernels/cuda/fp8_deepgemm.cu):
// compiled for kDeepGemmSms multiprocessors (gpu_ops.h, deepgemm_available()). A's scales
// one group of its M rows ([K / 128][M]: quantize_rows_blockwise with no offsets), B's as
// quantize_weight_blocks writes them; bf16 out, no beta; M a multiple of 4, operands
// 16-byte aligned, K a multiple of 128, N and ld_out multiples of 8.

// One dense GEMM through it: c [M, N] (row stride ldc) = a [M, K] @ b^T, as DenseGemmFp8's
// with beta 0.
void dense_gemm_deepgemm(bf16* c, int64_t ldc, const uint8_t* a_codes, const float* a_scales, const uint8_t* b_codes,
                         const float* b_scales, int64_t M, int64_t N, int64_t K, Stream stream);

// The experts' forward and data-gradient GEMMs through it over rows padded per expert:
// expert e owns rows [offsets_E1[e], offsets_E1[e + 1]) of R, offsets_E1[0] = 0 and every
// other offset a multiple of 128 (not checked: read on the device). A: the rows' codes
// [R, K] with their scales as one group; B as ExpertGemmFp8 takes it. Every row below
// offsets_E1[E] rounded up to 128 (and below R) is written; rows of an expert get their
// expert's product, as ExpertGemmFp8's.
class PaddedExpertGemmFp8 {
 public:
  static constexpr int64_t kMaxExperts = kDeepGemmMaxExperts, kMaxSets = 2;
  explicit PaddedExpertGemmFp8(int64_t max_experts);
  ~PaddedExpertGemmFp8();
  PaddedExpertGemmFp8(const PaddedExpertGemmFp8&) = delete;
  PaddedExpertGemmFp8& operator=(const PaddedExpertGemmFp8&) = delete;
  // As ExpertGemmFp8::forward (out[s] = x @ W_s^T per expert).
  void forward(int sets, bf16* const* out, int64_t ld_out, const uint8_t* x_codes, const float* x_scales,
               const uint8_t* const* w_codes, const float* const* w_scales, const int32_t* offsets_E1, int64_t R,
               int64_t N, int64_t K, Stream stream);
  // As ExpertGemmFp8::backward_data with beta 0.
  void backward_data(bf16* out, int64_t ld_out, const uint8_t* dy_codes, const float* dy_scales,
                     const uint8_t* wt_codes, const float* wt_scales, const int32_t* offsets_E1, int64_t R, int64_t N,
                     int64_t K, Stream stream);
  void set_experts(int64_t n_experts);

 private:
  struct State;
  State* state_;
};

// Dense FP8 GEMM for the projections: c [M, N] (bf16, row stride ldc) = a [M, K] @ b^T +
// beta * c, with a from quantize_rows_blockwise (no offsets) and b [N, K] from
// quantize_weight_blocks (E = 1; for dy @ W pass the transposed copy). K a multiple of
// 128, N and ldc multiples of 8.
class DenseGemmFp8 {
 public:
  DenseGemmFp8();
  ~DenseGemmFp8();
  DenseGemmFp8(const DenseGemmFp8&) = delete;
  DenseGemmFp8& operator=(const DenseGemmFp8&) = delete;
  void gemm(bf16* c, int64_t ldc, const uint8_t* a_codes, const float* a_scales, const uint8_t* b_codes,
            const float* b_scales, int64_t M, int64_t N, int64_t K, float beta, Stream stream);
  // As ExpertGemm's: launch on at most `sms` multiprocessors (0: all), whole clusters.
  void set_sm_limit(int sms);
  // on: a GEMM with beta 0 while no SM limit is set runs dense_gemm_deepgemm (refused where
  // deepgemm_available() is false); the others CUTLASS's.
  void use_deepgemm(bool on);

 private:
  struct State;
  State* state_;
};

}  // namespace moe::cuda
