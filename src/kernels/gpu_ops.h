// GPU versions of the dense ops (bf16 storage, fp32 math and statistics). Each is tested
// against the CPU op of the same name in kernels/<op>.h. Declared here without CUDA
// headers so host code can call them; `stream` is a cudaStream_t (nullptr: default).
// The MoE ops are declared in moe/gpu_ops.h, the optimizer's in optim/gpu_ops.h.
#pragma once
#include <cstddef>
#include <cstdint>

#include "config/training_config.h"  // AttentionDq
#include "core/bf16.h"

struct CUstream_st;

namespace moe::cuda {

using Stream = CUstream_st*;

// The branch a residual add takes: a [T, D] tensor, or gathered rows summed where they are
// read, branch[t] = bf16(sum_k weight_TK[t K + k] rows_RD[row_TK[t K + k]]) over the slots
// with row >= 0, k in order: the MoE combine's bits (moe::cuda::combine_forward) without
// its [T, D] output written and read back.
struct ResidualBranch {
  ResidualBranch(const bf16* rows_TD = nullptr) : rows(rows_TD) {}  // NOLINT: a tensor converts
  ResidualBranch(const bf16* rows_RD, const float* weight_TK_, const int32_t* row_TK_, int64_t K_)
      : rows(rows_RD), weight_TK(weight_TK_), row_TK(row_TK_), K(K_) {}
  bool gathered() const { return row_TK != nullptr; }
  explicit operator bool() const { return rows != nullptr; }
  const bf16* rows;
  const float* weight_TK = nullptr;
  const int32_t* row_TK = nullptr;
  int64_t K = 0;
};

// RMSNorm, optionally fused with the residual add before it:
// residual_out = x + branch (when branch is not null; else residual_out may be null and x is used),
// y = residual_out * rstd * w, rstd = 1/sqrt(mean(residual_out^2) + eps).
void rmsnorm_forward(bf16* y_TD, float* rstd_T, bf16* residual_out_TD, const bf16* x_TD,
                     const ResidualBranch& branch, const bf16* w_D, int64_t T, int64_t D, float eps,
                     Stream stream);
// dx = d rmsnorm/dx . dy (+ dresidual_TD when not null: the gradient arriving through
// the residual path); dw_D += sum over tokens (fp32, deterministic: per-block partials
// in `dw_partial_BD` of ceil(T / rows_per_block) x D floats, then summed in order).
void rmsnorm_backward(bf16* dx_TD, float* dw_D, const bf16* dy_TD, const bf16* dresidual_TD,
                      const bf16* x_TD, const bf16* w_D, const float* rstd_T, int64_t T, int64_t D,
                      float* dw_partial, Stream stream);
// Rows of tokens each block of rmsnorm_backward handles (sizes dw_partial).
int64_t rmsnorm_backward_partial_rows(int64_t T);

// act = silu(gate) * up; gate_up_TF2 holds [gate | up] per row (F each).
void swiglu_forward(bf16* act_TF, const bf16* gate_up_TF2, int64_t T, int64_t F, Stream stream);
// act_TF (optional): also act as swiglu_forward writes it, from the same read of gate|up
// (the backward of rows whose forward is recomputed: one read of gate|up instead of two).
void swiglu_backward(bf16* dgate_up_TF2, const bf16* dact_TF, const bf16* gate_up_TF2, int64_t T, int64_t F,
                     Stream stream, bf16* act_TF = nullptr);

// RoPE's angles: (cos, sin) of pos * theta^(-2i/d) for pos < S, i < d/2, as [S, d/2, 2] fp32.
void rope_table(float* cos_sin_Sh2, int64_t S, int64_t d, float theta, Stream stream);
// RoPE in place on [T, N, d] (rotate_half layout), positions_T per token (each < the
// table's S), angles from rope_table. ld: elements from one token's heads to the next's
// (0: N d); the fused q|k|v rows [T, (H + 2G) d] turn their H + G q and k heads at once.
void rope_forward(bf16* x_TNd, const int32_t* positions_T, const float* cos_sin_Sh2, int64_t T, int64_t N, int64_t d,
                  Stream stream, int64_t ld = 0);
void rope_backward(bf16* dx_TNd, const int32_t* positions_T, const float* cos_sin_Sh2, int64_t T, int64_t N,
                   int64_t d, Stream stream, int64_t ld = 0);

// Cross-entropy and its gradient in one pass, from fp32 logits (the LM head's GEMM writes
// them a chunk of rows at a time, so the [T, V] fp32 logits never exist whole; bf16 logits
// would cost ~1% relative error in every gradient). loss_T gets each row's loss (0 for
// ignored targets, -1); dlogits_TV = grad_scale * (softmax - onehot) in bf16, zeros for
// ignored rows. With grad_scale = 1 / n_valid the backward only multiplies by dloss.
void cross_entropy_fused(float* loss_T, bf16* dlogits_TV, const float* logits_TV, const int32_t* targets_T,
                         int64_t T, int64_t V, float grad_scale, Stream stream);

}  // namespace moe::cuda

namespace moe::cuda {

// Embedding: out_TD = table_VD[ids_T] (bf16). Backward into an fp32 table gradient,
// deterministic: the tokens are sorted by id (stable), and each id's rows are summed in
// token order. scratch from embedding_backward_scratch_bytes.
void embedding_forward(bf16* out_TD, const int32_t* ids_T, const bf16* table_VD, int64_t T, int64_t V, int64_t D,
                       Stream stream);
size_t embedding_backward_scratch_bytes(int64_t T);
void embedding_backward(float* dtable_VD, const int32_t* ids_T, const bf16* dout_TD, int64_t T, int64_t V,
                        int64_t D, void* scratch, size_t scratch_bytes, Stream stream);

}  // namespace moe::cuda

namespace moe::cuda {

// cuBLASLt for the dense matmuls: one handle, one workspace, algorithms cached per shape.
class Blas {
 public:
  explicit Blas(size_t workspace_bytes = size_t{32} << 20);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  // Row-major C[M,N] = alpha * op(A)[M,K] op(B)[K,N] + beta * C with bf16 A and B and
  // fp32 accumulation; C is fp32 when c_is_fp32 (weight gradients), else bf16.
  // op(A) = A ([M,K], lda) or A^T (A stored [K,M]); likewise B.
  void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
            const bf16* B, int64_t ldb, float beta, void* C, bool c_is_fp32, int64_t ldc, Stream stream);
  // The multiprocessors cuBLASLt's kernels should use from now on (0: all), e.g. to leave
  // some free for NCCL kernels running beside them (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET).
  void set_sm_limit(int sms);

 private:
  struct State;
  State* state_;
};

}  // namespace moe::cuda

namespace moe::cuda {

// Causal grouped-query attention through cuDNN's flash attention (SDPA). q_BSHd and
// out_BSHd: [B, S, H, d]; k, v: [B, S, G, d]; stats_BHS: fp32 log-sum-exp per query
// (saved for the backward). Graphs are built on first use of a shape and cached.
// ld_q, ld_kv: elements from one token's q (k, v) heads to the next token's, for q, k, v
// and dq, dk, dv alike (0: packed, H d and G d): the fused projection's q|k|v rows of
// (H + 2G) d are read, and their gradients written, where they lie.
class Attention {
 public:
  Attention();
  ~Attention();
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;
  // How the backward sums dQ (AttentionDq::Workspace by default): Ordered is the Hopper
  // engine's fixed-order tile sum (cuDNN >= 9.25, sm_90), refused in one line elsewhere when
  // the backward's graph is built.
  void set_dq(AttentionDq dq);
  // The backward in `chunks` calls over consecutive blocks of queries (1 by default), the
  // last first, each against the keys up to its last query (causal from the bottom right):
  // the deterministic backward's dP of a call covers its rows' keys only, (n + 1) / 2n of
  // the whole S x S, and the workspace is the last chunk's; each chunk's dK, dV are added to
  // the later chunks' in that fixed order (bf16, one rounding each; training.
  // attention_query_chunks, docs/DETERMINISM.md). A memory option: cuDNN runs these
  // non-square graphs slower (+21% attention time at 4 on olmoe-mini, BENCHMARKS.md).
  void set_query_chunks(int64_t chunks);
  // Whether AttentionDq::Ordered runs with the cuDNN and the GPU of this process.
  static bool ordered_dq_runs();
  // The device workspace the forward and the backward of this shape take (their graphs are
  // built now and cached): what use_workspace must hold for them.
  size_t workspace_bytes(int64_t B, int64_t S, int64_t H, int64_t G, int64_t d, float scale, int64_t ld_q = 0,
                         int64_t ld_kv = 0);
  // Runs in `bytes` at `workspace` (memory its owner shares with other scratch) instead of
  // an allocation of its own; a graph needing more is an error. nullptr: its own again.
  void use_workspace(void* workspace, size_t bytes);
  void forward(bf16* out_BSHd, float* stats_BHS, const bf16* q_BSHd, const bf16* k_BSGd, const bf16* v_BSGd,
               int64_t B, int64_t S, int64_t H, int64_t G, int64_t d, float scale, Stream stream, int64_t ld_q = 0,
               int64_t ld_kv = 0);
  // Overwrites dq, dk and dv.
  void backward(bf16* dq_BSHd, bf16* dk_BSGd, bf16* dv_BSGd, const bf16* dout_BSHd, const bf16* q_BSHd,
                const bf16* k_BSGd, const bf16* v_BSGd, const bf16* out_BSHd, const float* stats_BHS, int64_t B,
                int64_t S, int64_t H, int64_t G, int64_t d, float scale, Stream stream, int64_t ld_q = 0,
                int64_t ld_kv = 0);

 private:
  struct State;
  State* state_;
};

}  // namespace moe::cuda

namespace moe::cuda {

// *out = scale * sum(values[0..n)), summed in a fixed order by one block.
void ordered_sum(float* out, const float* values, int64_t n, float scale, Stream stream);

}  // namespace moe::cuda

namespace moe::cuda {

// x_RC[r, c] += bias_C[c] (fp32).
void add_bias_rows(float* x_RC, const float* bias_C, int64_t rows, int64_t cols, Stream stream);
void cast_to_bf16(bf16* out, const float* in, int64_t n, Stream stream);
void cast_to_float(float* out, const bf16* in, int64_t n, Stream stream);  // exact
// dst[b, r, :cols] += src[b, r, :cols] for rows r < `rows` of each of B batches of S rows
// (row (b S + r) at r * ld within a batch of S ld), added in fp32 and rounded to bf16 once:
// the key and value gradients of the attention backward's query chunks.
void add_batched_rows(bf16* dst, int64_t ld_dst, const bf16* src, int64_t ld_src, int64_t B, int64_t S, int64_t rows,
                      int64_t cols, Stream stream);

// kernels/cuda/exact_math.cuh's branch-free fast paths against nvcc's IEEE operations, on
// the device, for the tests: counts_6 = {sqrt(a[i]) taken fast and differing, a[i] / b[i]
// taken fast and differing, sqrt taken fast, division taken fast, 1 / b[i] taken fast and
// differing, reciprocal taken fast} (device, added to).
void exact_math_mismatches(unsigned long long* counts_6, const float* a, const float* b, int64_t n, Stream stream);
// out_C[c] += sum over rows of x_RC[r, c], in a fixed order (groups of rows, then the
// groups); partial: column_sums_partial_count(rows, cols) floats of scratch.
int64_t column_sums_partial_count(int64_t rows, int64_t cols);
void add_column_sums(float* out_C, const float* x_RC, int64_t rows, int64_t cols, float* partial, Stream stream);

}  // namespace moe::cuda

namespace moe::cuda {

// The experts' GEMMs over the device row layout: expert e owns rows
// [offsets_E1[e], offsets_E1[e + 1]) of every row buffer. The offsets are read on the
// device (CUTLASS's Hopper grouped GEMM with device-side problem sizes), so dropless
// routing needs no host synchronisation and empty experts cost nothing. `sets` (1 or 2)
// runs that many independent expert GEMMs in one launch (the gate and up projections).
// Widths and leading dimensions must be multiples of 8 elements (16-byte TMA rows).
class ExpertGemm {
 public:
  // Room for up to max_experts experts per call; the calls run over all of them until
  // set_experts says otherwise.
  explicit ExpertGemm(int64_t max_experts);
  ~ExpertGemm();
  ExpertGemm(const ExpertGemm&) = delete;
  ExpertGemm& operator=(const ExpertGemm&) = delete;
  static constexpr int kMaxSets = 2;
  // out[s] rows of e ([rows_e, N], ld_out) = x rows of e ([rows_e, K], ld_x) @ W^T, where
  // W = w[s] + e * N * K is stored [N, K] (a Linear weight).
  void forward(int sets, bf16* const* out, int64_t ld_out, const bf16* x, int64_t ld_x, const bf16* const* w,
               const int32_t* offsets_E1, int64_t N, int64_t K, Stream stream);
  // out rows of e ([rows_e, N], ld_out) = dy rows of e ([rows_e, K], ld_dy) @ W + beta * out,
  // where W = w + e * K * N is stored [K, N].
  void backward_data(bf16* out, int64_t ld_out, const bf16* dy, int64_t ld_dy, const bf16* w,
                     const int32_t* offsets_E1, int64_t N, int64_t K, float beta, Stream stream);
  // dw[s] + e * M * N ([M, N], fp32) = beta * dw + (a[s] rows of e, [rows_e, M], ld_a)^T @
  // (b rows of e, [rows_e, N], ld_b). beta 1 accumulates; beta 0 writes without reading dw
  // (the step's first micro-batch: no zeroing pass), experts without rows getting zeros.
  void backward_weight(int sets, float* const* dw, const bf16* const* a, int64_t ld_a, const bf16* b, int64_t ld_b,
                       const int32_t* offsets_E1, int64_t M, int64_t N, Stream stream, float beta = 1.0f);
  // The same into bf16 gradients: fp32 accumulation, dw read and added in fp32, rounded to
  // bf16 (nearest even) once (training.expert_grad_dtype = bf16).
  void backward_weight(int sets, bf16* const* dw, const bf16* const* a, int64_t ld_a, const bf16* b, int64_t ld_b,
                       const int32_t* offsets_E1, int64_t M, int64_t N, Stream stream, float beta = 1.0f);
  // The kernels are persistent (a CTA per multiprocessor for the whole launch), so they
  // shut out kernels on other streams, NCCL's included, until they end. From now on they
  // launch on `sms` multiprocessors rounded down to whole clusters of 2 (0 or more than
  // the device has: all of them).
  void set_sm_limit(int sms);
  // The experts the next calls run over (0 .. max_experts; 0: the calls do nothing), e.g.
  // an EP rank's count in one MoE layer after a re-placement by load.
  void set_experts(int64_t n_experts);

 private:
  template <typename Grad>
  void backward_weight_into(int sets, Grad* const* dw, const bf16* const* a, int64_t ld_a, const bf16* b, int64_t ld_b,
                            const int32_t* offsets_E1, int64_t M, int64_t N, Stream stream, float beta);
  struct State;
  State* state_;
};

// DeepGEMM's Hopper kernels (headers of the PyPI wheel sgl-deep-gemm; kernels/cuda/
// fp8_deepgemm.cu, bf16_deepgemm.cu) are compiled for kDeepGemmSms multiprocessors (an
// H100 / H200 SXM) and run on all of them; deepgemm_available() says whether this device
// can run them.
inline constexpr int64_t kDeepGemmSms = 132;
bool deepgemm_available();

// The experts' bf16 GEMMs through DeepGEMM's Hopper bf16 kernel (sm90_bf16_gemm;
// training.bf16_gemm_backend = deepgemm) over rows padded per expert: expert e owns rows
// [offsets_E1[e], offsets_E1[e + 1]) of R, offsets_E1[0] = 0 and every offset a multiple of
// 128 (read on the device, not checked), the padding rows of every row operand zero.
// Shapes: every N, K, M and leading dimension a multiple of 64, R of 4; operands 16-byte
// aligned. Deterministic; fp32 accumulation, bf16 out rounded once (backward_data with
// beta 1 rounds twice: the product, then the sum, where ExpertGemm rounds the sum once).
class PaddedExpertGemmBf16 {
 public:
  static constexpr int64_t kMaxExperts = kDeepGemmMaxExperts, kMaxSets = 2;
  // The weight gradients are worth its kernel up to this many experts (the model's choice:
  // GpuTransformer's deepgemm_weight_gradients).
  static constexpr int64_t kWeightGradientExperts = 16;
  explicit PaddedExpertGemmBf16(int64_t max_experts);
  ~PaddedExpertGemmBf16();
  PaddedExpertGemmBf16(const PaddedExpertGemmBf16&) = delete;
  PaddedExpertGemmBf16& operator=(const PaddedExpertGemmBf16&) = delete;
  // As ExpertGemm::forward: out[s] rows of e = x rows of e @ (w[s] + e * N * K)^T.
  void forward(int sets, bf16* const* out, int64_t ld_out, const bf16* x, int64_t ld_x, const bf16* const* w,
               const int32_t* offsets_E1, int64_t R, int64_t N, int64_t K, Stream stream);
  // The gate|up projection with SwiGLU in the GEMM's epilogue (our own kernel): gate_up
  // [R, 2F] as forward writes it with w = the experts' interleaved [w1_e; w3_e] ([E][2F][K]),
  // and act [R, F] as swiglu_forward writes it from that gate_up, bit for bit. F: a multiple
  // of kSwigluColumns.
  static constexpr int64_t kSwigluColumns = 128;
  void forward_swiglu(bf16* gate_up, bf16* act, const bf16* x, int64_t ld_x, const bf16* w, const int32_t* offsets_E1,
                      int64_t R, int64_t F, int64_t K, Stream stream);
  // The down projection's data gradient with SwiGLU's backward (our own kernel): d act =
  // dy [R, K] @ W2_e (w2 [E][K][F] as stored) as backward_data rounds it, kept on chip, and
  // from it and gate_up [R, 2F] d gate|up [R, 2F] and (act not null) act [R, F] as
  // swiglu_backward writes them, bit for bit. F: a multiple of kSwigluColumns.
  void backward_data_swiglu(bf16* dgate_up, bf16* act, const bf16* dy, int64_t ld_dy, const bf16* w2,
                            const bf16* gate_up, const int32_t* offsets_E1, int64_t R, int64_t F, int64_t K,
                            Stream stream);
  // As ExpertGemm::backward_data, beta 0 (written) or 1 (added).
  void backward_data(bf16* out, int64_t ld_out, const bf16* dy, int64_t ld_dy, const bf16* w,
                     const int32_t* offsets_E1, int64_t R, int64_t N, int64_t K, float beta, Stream stream);
  // As ExpertGemm::backward_weight into bf16 gradients with beta 0: dw[s] + e * M * N =
  // (a[s] rows of e)^T @ (b rows of e), experts without rows getting zeros.
  void backward_weight(int sets, bf16* const* dw, const bf16* const* a, int64_t ld_a, const bf16* b, int64_t ld_b,
                       const int32_t* offsets_E1, int64_t R, int64_t M, int64_t N, Stream stream);
  void set_experts(int64_t n_experts);

 private:
  struct State;
  State* state_;
};

}  // namespace moe::cuda

namespace moe::cuda {

// The fp32 master weights as bf16 hi + int16 lo halves (adamw_math::split_master), and back.
void split_master(bf16* hi, int16_t* lo, const float* x, int64_t n, Stream stream);
void join_master(float* x, const bf16* hi, const int16_t* lo, int64_t n, Stream stream);
// bf16 rounding to nearest even with adamw_math's bits (the moments), and widening.
void round_to_bf16(bf16* out, const float* in, int64_t n, Stream stream);
void widen_bf16(float* out, const bf16* in, int64_t n, Stream stream);
// fp8 moments (adamw_math's format): n moments of state elements first.. as codes (codes[i]
// is element first + i's) with a scale byte per block of 16 in scales[state / 16]; `root`:
// the second moment (its codes are sqrt(v)'s). Quantise (as step 0 rounds: the uploads'
// bits; `index`: the block offset of element first, for them): first a multiple of 16,
// whole blocks (the last may stop early: the rest is padding no range owns). Dequantise:
// any range.
void quantize_moments(uint8_t* codes, uint8_t* scales, const float* in, int64_t first, int64_t index, int64_t n,
                      bool root, Stream stream);
void dequantize_moments(float* out, const uint8_t* codes, const uint8_t* scales, int64_t first, int64_t n, bool root,
                        Stream stream);

}  // namespace moe::cuda

