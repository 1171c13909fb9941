// Fine-grained (blockwise) fp8 e4m3 quantisation for the FP8 GEMMs (docs/FP8.md): the
// CPU reference of the GPU's quantisation kernels (kernels/fp8_gpu_ops.h), bit for bit.
// Activations get one scale per row and 128 columns (1 x 128 tiles along K), weights one
// per 128 x 128 block (DeepSeek-V3's recipe). The scales are powers of two, so
// value = decode(code) * scale is exact, dequantisation and the scale products inside the
// GEMM lose nothing, and quantising W^T gives exactly the transpose of quantising W.
//
// Scale layouts (what CUTLASS's Hopper blockwise-scaled GEMM reads, M/N-major):
//  - activation rows, grouped by expert (expert e owns rows [first_e, first_e + rows_e)):
//    expert e's scales start at first_e * KB and are [KB][rows_e] (rows contiguous), so
//    scale(r, kb) = scales[first_e * KB + kb * rows_e + (r - first_e)]; R rows in one
//    group (no offsets) is the same with first = 0, rows = R. KB = K / 128.
//  - weights [E, N, K] (B of x @ W^T): expert e's scales are [KB][NB] (n-blocks
//    contiguous) at e * NB * KB; the transposed copy W^T [E, K, N] (B of dy @ W) has
//    [NB][KB] (k-blocks contiguous), i.e. the same grid in the other order.
#pragma once
#include <bit>
#include <cstdint>
#include <vector>

#include "core/bf16.h"
#include "core/fp8.h"  // fp8::kBlock

namespace moe::fp8 {

constexpr int64_t blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// The scale of a tile of absolute maximum `amax`: the smallest power of two 2^e with
// amax / 2^e <= 448 (e4m3's largest finite), e >= -126 (a normal float); 1 for a tile of
// zeros or a non-finite amax. Exact integer work on the float's bits, so the host and the
// device agree (constexpr: nvcc's --expt-relaxed-constexpr lets kernels call it).
constexpr float block_scale(float amax) {
  const uint32_t u = std::bit_cast<uint32_t>(amax);
  const uint32_t biased = (u >> 23) & 0xffu;
  if (u == 0 || (u >> 31) != 0 || biased == 0xffu) return 1.0f;
  if (biased == 0) return std::bit_cast<float>(uint32_t{1} << 23);  // subnormal amax: 2^-126
  // amax = 1.m * 2^(biased - 127) <= 1.75 * 2^(8 + e)  <=>  e >= biased - 135 (+1 if 1.m > 1.75)
  int e = static_cast<int>(biased) - 135 + ((u & 0x7fffffu) > 0x600000u ? 1 : 0);
  if (e < -126) e = -126;
  return std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23);
}

// 1 / scale for a block_scale (a power of two 2^e, -126 <= e <= 120): 2^-e from the bits,
// exactly the quotient 1.0f / scale without a division (on the GPU an IEEE division is a
// branch and a call that keep the compiler from interleaving the tiles' work).
constexpr float block_scale_inverse(float scale) {
  return std::bit_cast<float>((uint32_t{254} << 23) - std::bit_cast<uint32_t>(scale));
}

constexpr int64_t activation_scale_index(int64_t first, int64_t rows, int64_t r, int64_t kb, int64_t KB) {
  return first * KB + kb * rows + (r - first);
}
// Which groups a kernel writing expert rows' codes lays their scales out over: the experts'
// (ExpertGemmFp8's operands), or one group of all R rows (rows padded per expert to 128:
// PaddedExpertGemmFp8's, [KB][R], whatever the experts).
enum class RowScales { PerExpert, OneGroup };
constexpr int64_t weight_scale_index(int64_t e, int64_t nb, int64_t kb, int64_t NB, int64_t KB) {
  return (e * KB + kb) * NB + nb;
}
constexpr int64_t weight_t_scale_index(int64_t e, int64_t nb, int64_t kb, int64_t NB, int64_t KB) {
  return (e * NB + nb) * KB + kb;
}

// Where quantize_weight_blocks writes one copy of a tensor inside a larger array: expert
// e's code at (row i, column j) at e * expert_codes + i * codes_ld + j, its scale at (row
// i, column j) of the scale grid at e * expert_scales + i * scales_ld + j. Zeros: the copy
// packed alone (codes [E, rows, cols], scales [E, scale rows, scale cols]). Rows and
// columns are the copy's own: as stored, codes [N, K] and scales [KB][NB]; transposed,
// codes [K, N] and scales [NB][KB].
struct WeightBlocksPlace {
  int64_t expert_codes = 0, codes_ld = 0, expert_scales = 0, scales_ld = 0;
  // The zeros filled in for a copy of rows x cols codes and scale_rows x scale_cols scales.
  constexpr WeightBlocksPlace resolved(int64_t rows, int64_t cols, int64_t scale_rows, int64_t scale_cols) const {
    WeightBlocksPlace p = *this;
    if (p.codes_ld == 0) p.codes_ld = cols;
    if (p.expert_codes == 0) p.expert_codes = rows * p.codes_ld;
    if (p.scales_ld == 0) p.scales_ld = scale_cols;
    if (p.expert_scales == 0) p.expert_scales = scale_rows * p.scales_ld;
    return p;
  }
  constexpr int64_t code(int64_t e, int64_t i, int64_t j) const { return e * expert_codes + i * codes_ld + j; }
  constexpr int64_t scale(int64_t e, int64_t i, int64_t j) const { return e * expert_scales + i * scales_ld + j; }
};

// W1 and W3 (each [E, F, D]) as one gate|up operand of the padded experts' GEMMs
// (training.fp8_gemm_backend = deepgemm): as stored, expert e's [W1_e; W3_e] [2F, D] (the
// forward as one GEMM over N = 2F); transposed, [W1_e^T | W3_e^T] [D, 2F] (the data
// gradient as one GEMM over K = 2F); each with its scales as quantising that [E, 2F, D]
// tensor whole gives (F a multiple of 128: no block straddles the two). `part` 0 is W1's,
// 1 W3's: where its codes and scales start in the operand's arrays, and its place there.
struct GateUpPart {
  int64_t codes_offset = 0, scales_offset = 0;
  WeightBlocksPlace place;
};
constexpr GateUpPart gate_up_part(int part, bool transposed, int64_t F, int64_t D) {
  const int64_t FB = blocks(F), DB = blocks(D);
  if (!transposed)  // codes [E][2F][D], scales [E][DB][2 FB]
    return {part * F * D, part * FB, {2 * F * D, D, 2 * FB * DB, 2 * FB}};
  return {part * F, part * FB * DB, {2 * F * D, 2 * F, 2 * FB * DB, DB}};  // codes [E][D][2F], scales [E][2 FB][DB]
}

// Whether the dense FP8 GEMM (kernels/fp8_gpu_ops.h's DenseGemmFp8) takes c [M, N] (row
// stride ldc) = a [M, K] (bf16 row stride lda, quantised first) @ b [N, K]^T: K in whole
// 128-blocks (one scale per block along K), M a multiple of 4 (TMA rows of a's [KB][M]
// scales), N, ldc and lda multiples of 8 (16-byte rows). training.precision = fp8 runs a
// dense projection in fp8 exactly when this holds, else in bf16 (docs/FP8.md).
constexpr bool dense_gemm_fits(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldc) {
  return M > 0 && M % 4 == 0 && K > 0 && K % kBlock == 0 && N > 0 && N % 8 == 0 && ldc >= N && ldc % 8 == 0 &&
         lda >= K && lda % 8 == 0 && M < (int64_t{1} << 31) && N < (int64_t{1} << 31) && K < (int64_t{1} << 31);
}

// Activation rows x [R, K] (row stride ld_x) -> codes [R, K] (packed) and scales as above.
// offsets_E1 (E + 1 values, or null for one group of all R rows): only the rows below
// offsets[E] are written. K must be a multiple of 128.
void quantize_rows_blockwise(uint8_t* codes_RK, float* scales, const bf16* x, int64_t ld_x,
                             const int32_t* offsets_E1, int64_t E, int64_t R, int64_t K);
// The inverse: x[r, k] = decode(code) * scale, for the rows below offsets[E].
void dequantize_rows_blockwise(float* x_RK, const uint8_t* codes_RK, const float* scales, const int32_t* offsets_E1,
                               int64_t E, int64_t R, int64_t K);

// Weights w [E, N, K] -> codes [E, N, K] and scales [E][KB][NB], and the transposed copy
// codes_t [E, K, N] with scales_t [E][NB][KB] (either pair may be null, not both), each
// packed or where `place` / `place_t` puts it (WeightBlocksPlace). Edge blocks (N or K not
// a multiple of 128) take the amax of their part.
void quantize_weight_blocks(uint8_t* codes_ENK, float* scales, uint8_t* codes_t_EKN, float* scales_t,
                            const bf16* w_ENK, int64_t E, int64_t N, int64_t K, WeightBlocksPlace place = {},
                            WeightBlocksPlace place_t = {});
// The places of a quantize_weight_blocks call resolved and checked (one-line errors): rows
// that overlap inside an expert, or experts that overlap, are refused.
struct WeightBlocksPlaces {
  WeightBlocksPlace stored, transposed;
};
WeightBlocksPlaces resolve_weight_places(int64_t N, int64_t K, WeightBlocksPlace place, WeightBlocksPlace place_t);
void dequantize_weight_blocks(float* w_ENK, const uint8_t* codes_ENK, const float* scales, int64_t E, int64_t N,
                              int64_t K);

// Token columns: the operands of the experts' weight gradients in fp8 (dW_e = dy_e^T x_e, the
// tokens as the GEMM's K; docs/FP8.md "Still to do"). Expert e's rows [first_e, first_e +
// rows_e) of x [R, W] go transposed to columns [P_e, P_e + rows_e) of codes_t [W, ld_t],
// where P_e = padded_token_offsets(...)[e] (each expert's columns rounded up to 128, the
// padding zero codes) and ld_t >= P, the last offset (the GPU's buffers take a bound on P
// known before the routing: R + 127 E); one scale per feature and 128 of the expert's tokens,
// features contiguous (CUTLASS's 1 x 1 x 128 granularity, MN-major: group e's scales start
// at P_e / 128 * W).
//
// Block: one scale per 128 features and 128 tokens instead (CUTLASS's 1 x 128 x 128 for the
// GEMM's B, the granularity of the forward's weights), blocks(W) a token block, feature
// blocks contiguous: group e's scales start at P_e / 128 * blocks(W). The design for the
// weight GEMMs' B side (x's and act's columns): docs/FP8.md "Still to do"; the GPU does not
// take it yet.
enum class ColumnScales { PerFeature, Block };
std::vector<int64_t> padded_token_offsets(const int32_t* offsets_E1, int64_t E);  // E + 1 values
constexpr int64_t token_column_scale_index(int64_t P_e, int64_t tb, int64_t f, int64_t W) {
  return (P_e / kBlock + tb) * W + f;
}
constexpr int64_t token_column_block_scale_index(int64_t P_e, int64_t tb, int64_t f, int64_t W) {
  return (P_e / kBlock + tb) * blocks(W) + f / kBlock;
}
constexpr int64_t token_column_scale_at(ColumnScales kind, int64_t P_e, int64_t tb, int64_t f, int64_t W) {
  return kind == ColumnScales::Block ? token_column_block_scale_index(P_e, tb, f, W)
                                     : token_column_scale_index(P_e, tb, f, W);
}
void quantize_token_columns(uint8_t* codes_t_WP, int64_t ld_t, float* scales_t, const bf16* x, int64_t ld_x,
                            const int32_t* offsets_E1, int64_t E, int64_t W,
                            ColumnScales kind = ColumnScales::PerFeature);

// The weight gradients from two such operands, as the blockwise-scaled GEMM computes them:
// dw_e [N, K] (+= when accumulate) = sum over expert e's 128-token blocks tb of
// a_scale(n, tb) * b_scale(k, tb) * (the block's code products summed in fp32), with a the
// token columns of dy [N, ld_t] (per-feature scales) and b those of x [K, ld_t] (b_kind's).
// fp32 as the tensor cores promote.
void weight_gradient_token_columns(float* dw_ENK, const uint8_t* a_t_NP, const float* a_scales,
                                   const uint8_t* b_t_KP, const float* b_scales, int64_t ld_t,
                                   const std::vector<int64_t>& P_E1, int64_t N, int64_t K, bool accumulate,
                                   ColumnScales b_kind = ColumnScales::PerFeature);

}  // namespace moe::fp8
