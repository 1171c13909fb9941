// The GPU model's private state, shared by its source files: gpu_transformer.cpp (the
// step, planning, parameters), gpu_attention.cpp (the attention block: fused q|k|v
// projection, RoPE, SDPA), gpu_moe.cpp (the MoE layer: router, experts, balancing; the
// dispatch and combine are its ExpertDispatcher's) and gpu_placement.cpp. Not part of
// the public interface.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cmath>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda/phase_clock.h"
#include "core/gpu.h"
#include "kernels/gpu_ops.h"
#include "kernels/fp8_gpu_ops.h"
#include "model/cuda/expert_dispatcher.h"
#include "model/cuda/gpu_layers.h"
#include "model/cuda/gpu_phases.h"
#include "model/cuda/gpu_transformer.h"
#include "model/cuda/projection_gemms.h"

namespace moe {

// Only the model's own source files above include this header.
using namespace gpu_model;  // NOLINT(google-build-using-namespace)

// Softmax scale of the attention (the cuDNN graphs' key: plan and the calls agree).
inline float attention_scale(int64_t head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

struct GpuTransformer::State {
  ModelConfig config;
  // Weights (bf16 hi + int16 lo = the fp32 masters), gradients and AdamW moments, in
  // the CPU store's layout (model/cuda/gpu_parameters.h).
  std::unique_ptr<GpuParameterStore> store;
  Param embedding, final_norm, head;
  std::vector<Layer> layers;
  cuda::Blas blas;
  cuda::Attention attention;
  std::unique_ptr<cuda::ExpertGemm> expert_gemm;  // MoE models only, over the local experts
  // training.precision = fp8 (GpuModelOptions::fp8_experts): the experts' forward and
  // data-gradient GEMMs in fp8 (docs/FP8.md). The rows are quantised right before each
  // GEMM into scratch shared by the layers (codes, 1x128 scales); the weights once after
  // they change, per layer (Layer::fp8, gpu_moe_fp8.cpp), or, without the cache
  // (fp8_weight_cache off), before each GEMM too, into scratch for two weight tensors of
  // the local experts (codes, 128x128 scales; the transposed copy for the data gradients).
  bool fp8 = false, fp8_weight_cache = true;
  std::unique_ptr<cuda::ExpertGemmFp8> expert_gemm_fp8;
  // GpuModelOptions::fp8_deepgemm: each expert's rows start at a multiple of 128 (the
  // padding rows zero: zero_expert_padding), the rows' scales are one group of R rows, and
  // the forward and data-gradient GEMMs are PaddedExpertGemmFp8's (DeepGEMM's kernel). The
  // gate and up data gradients go to dx_rows and drows, summed by the dispatch's backward.
  bool fp8_padded_rows = false;
  std::unique_ptr<cuda::PaddedExpertGemmFp8> padded_expert_gemm_fp8;
  // fp8_padded_rows, or GpuModelOptions::bf16_deepgemm: the same padded layout with the bf16
  // GEMMs on PaddedExpertGemmBf16 (DeepGEMM's bf16 kernel); its weight gradients where
  // deepgemm_weight_gradients says.
  bool padded_rows = false;
  std::unique_ptr<cuda::PaddedExpertGemmBf16> padded_expert_gemm_bf16;
  // GpuModelOptions::interleave_gate_up in effect: w1_e, w3_e adjacent in the bf16 weights,
  // read as one [2F, D] operand an expert (Fp8ExpertWeights::kGateUp through local_w of w1).
  bool gate_up_interleaved = false;
  // GpuModelOptions::swiglu_in_gemm in effect (gate|up interleaved, F in 128-column tiles).
  bool swiglu_in_gemm = false;
  // combine_in_next_norm: the MoE layers' combine is summed by the next norm (no ffn_out).
  bool combine_in_norm = false;
  // Interleaves every MoE layer's w1 | w3 in the store and sets gate_up_interleaved, where
  // each layer's w3 follows its w1 and an expert's F x D is a multiple of kNormChunk (the
  // AdamW chunks then lie in one expert's slice); else leaves the layout as it is.
  void interleave_gate_up();
  bool deepgemm_weight_gradients(const Layer& layer) const;
  int64_t expert_row_align() const { return padded_rows ? 128 : 1; }
  // padded_rows: zero the padding rows of `rows` [R, D] and, unless null, their codes
  // (one group of R rows) after a dispatch or combine backward wrote the routed ones.
  void zero_expert_padding(const Layer& layer, bf16* rows, uint8_t* codes, float* scales);
  Buffer<uint8_t> fp8_rows, fp8_weights;
  Buffer<float> fp8_row_scales, fp8_weight_scales;
  // GpuModelOptions::fp8_weight_gradients: the experts' weight gradients in fp8 too, from
  // token columns (each expert's rows transposed, padded to 128 tokens) in scratch shared by
  // the layers (fp8_token_column_sizes: fp8_ld_t padded tokens for dim + 2 hidden features)
  // and the layer's padded offsets, made in its backward (expert_backward_weight). x's and
  // act's columns (the GEMMs' B) scaled per fp8_column_b_scales, dy's per feature.
  bool fp8_weight_gradients = false;
  fp8::ColumnScales fp8_column_b_scales = fp8::ColumnScales::PerFeature;
  std::unique_ptr<cuda::ExpertWeightGemmFp8> expert_weight_gemm_fp8;
  Buffer<uint8_t> fp8_columns;
  Buffer<float> fp8_column_scales;
  Buffer<int64_t> fp8_padded_offsets;
  int64_t fp8_ld_t = 0;
  // The dense projections' forward and data-gradient GEMMs (attention's q|k|v and output,
  // the dense FFN and shared experts), bf16 or (GpuModelOptions::fp8_projections) fp8
  // where the shape fits: projection / projection_backward below.
  std::unique_ptr<ProjectionGemms> projections;
  void allocate_fp8_expert_weights(int64_t capacity);  // every MoE layer's, room for `capacity` experts; stale
  Fp8ExpertWeights& fp8_expert_weights(Layer& layer);  // re-quantised first when stale
  void refresh_fp8_expert_weights();  // every MoE layer's (before a CUDA graph runs)
  // Expert parallelism (GpuModelOptions::expert_exchange): this rank computes each MoE layer's slots
  // [first_slot_P1[rank], first_slot_P1[rank + 1]) (Layer); without it, all of them.
  // max_local_experts bounds a rank's count (GpuModelOptions; the plan's buffers and
  // the grouped GEMMs are sized for it), max_local_rows the rows it may compute.
  std::shared_ptr<GpuExpertExchange> ep;
  int64_t max_local_experts = 0, max_local_rows = 0;
  int64_t local_experts_cap = 0;  // GpuModelOptions::max_local_experts (0: E / P, + 1 with split experts)
  // split_experts: each block's first slot is shared with the rank before it, and every
  // micro-batch's cuts even the ranks' rows (the kept rows per slot gathered from all).
  bool split_experts = false;
  // Where the routed rows meet the experts: local, or over `ep` (made at plan()).
  std::unique_ptr<ExpertDispatcher> dispatcher;
  // moe.speculative_dispatch: the guessers (GpuTransformer::Routing::set_predictors), whether
  // this forward guesses, and its host token ids (valid while it is enqueued).
  std::vector<const RoutingCache*> route_predictors;
  bool speculating = false;
  const int32_t* host_inputs = nullptr;
  // After MoE layer `layer_index`'s forward: guess the next MoE layer's experts and arm its dispatch.
  void speculate_after(size_t layer_index);
  const RoutingCache* next_predictor(size_t layer_index, size_t* next_layer) const;
  cudaStream_t stream = nullptr;
  int64_t batch = 0, tokens = 0;
  int compute_sm_limit = 0;  // multiprocessors the GEMMs launch on (0: all); see reserve_sms
  int64_t recompute_layers = 0;  // the first N layers recompute their activations (-1: all)
  bool recomputing = false;      // inside a backward's recomputed forward
  ExpertRecompute recompute_experts = ExpertRecompute::None;
  int64_t recompute_experts_layers = -1;  // the first N MoE layers recompute their expert rows; -1: all
  // CUDA graphs of forward + backward of one micro-batch, replayed while the values baked
  // into their kernel arguments (valid targets, loss scale) stay the same: [1] for a step's
  // first micro-batch (expert gradients written with beta 0), [0] for the others.
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    int64_t n_valid = -1;
    double loss_scale = 0;
  };
  bool graphs = false;
  Graph graph[2];
  bool graph_warm = false;  // an eager step has run since plan()
  // Buffers or slots moved: captured graphs are stale, and the next step warms up eagerly.
  void drop_graphs() {
    for (Graph& g : graph) {
      if (g.exec) MOE_CUDA_CHECK(cudaGraphExecDestroy(g.exec));
      g = Graph{};
    }
    graph_warm = false;
  }
  // begin_gradients: the next backward writes the gradients of the tensors a weight-gradient
  // GEMM computes (the experts' grouped GEMMs and linear_backward's, with beta 0; experts
  // without rows zeroed) instead of adding to them; cleared when that backward is enqueued.
  bool overwrite_grads = false;
  // Rows the expert buffers hold: T * K, or fewer when the capacity bounds them. Row-wise
  // kernels run over all of them (static shapes, no host sync); only the rows below the
  // device-side offsets[E] are read by the GEMMs.
  int64_t max_rows = 0;
  // Per micro-batch buffers.
  Buffer<int32_t> inputs, targets, positions;
  Buffer<float> rope_cos_sin;  // [seq_len, head_dim / 2, 2]
  Buffer<bf16> final_x, final_n;
  // The LM head: fp32 logits for head_chunk_rows rows at a time, and the gradient of the
  // mean loss per logit (softmax - onehot) / n_valid, written by the forward.
  Buffer<float> head_logits_chunk;
  std::span<bf16> dlogits_head;  // device memory in shared_scratch
  int64_t head_chunk_rows = 0;
  Buffer<float> final_rstd, loss;
  // Device-side results of a forward, read back once at its end: [0] cross-entropy,
  // then per layer aux and z loss terms; kept rows per layer (offsets[E]).
  Buffer<float> sums;
  Buffer<int32_t> kept_rows;
  Buffer<double> routing_scratch;  // accumulate_routing_stats' per-block partial entropies
  // Backward scratch.
  Buffer<bf16> dres, dnorm, dqkv, dattn, dlogits_bf16, dffn_act, dffn_gate_up;
  // The MoE backward's row gradients: device memory in shared_scratch.
  std::span<bf16> drows, dact_rows, dgate_up_rows, dx_rows;
  // One allocation for three things a step never uses at once (docs/MEMORY_PLAN.md,
  // "Shared scratch"): dlogits_head (the LM head's loss to its backward), the MoE
  // backward's row gradients (within a MoE block's backward) and cuDNN's attention
  // workspace (within an attention call; the deterministic backward's dP of B x H x S x S
  // bf16). All on one stream, so each use ends before the next begins.
  Buffer<char> shared_scratch;
  Buffer<float> dweight, dlogits, norm_partial, column_partial;
  Buffer<char> embedding_scratch;
  int64_t n_valid = 0;
  ~State() {
    for (Graph& g : graph)
      if (g.exec) cudaGraphExecDestroy(g.exec);
    if (stream) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
  }
  gpu::PhaseClock* clock = nullptr;  // set_phase_clock
  // No events inside a captured CUDA graph.
  void mark(int phase) {
    if (clock && !capturing) clock->mark(phase, stream);
  }
  const bf16* w(const Param& p) const { return store->weights() + p.offset; }
  float* g(const Param& p) { return store->grads() + p.offset; }
  // fp32 values, for the parameters read in fp32 (the router biases; see the constructor).
  const float* w32(const Param& p) const { return store->fp32_copies().values(p.id); }

  // y[rows, out] = x[rows, in] @ W^T (+ y when accumulate).
  void linear(bf16* y, const bf16* x, const bf16* weight, int64_t rows, int64_t in, int64_t out, bool accumulate,
              int64_t ldy = -1) {
    blas.gemm(false, true, rows, out, in, 1.0f, x, in, weight, in, accumulate ? 1.0f : 0.0f, y, false,
              ldy < 0 ? out : ldy, stream);
  }
  // dx[rows, in] = scale * dy[rows, out] @ W (+ dx when accumulate); dW[out, in] += scale * dy^T @ x
  // (= when overwrite_grads).
  void linear_backward(bf16* dx, float* dweight, const bf16* dy, const bf16* x, const bf16* weight, int64_t rows,
                       int64_t in, int64_t out, bool accumulate_dx, int64_t ld_dy = -1, float scale = 1.0f) {
    const int64_t ldd = ld_dy < 0 ? out : ld_dy;
    if (dx) blas.gemm(false, false, rows, in, out, scale, dy, ldd, weight, in, accumulate_dx ? 1.0f : 0.0f, dx, false, in, stream);
    // begin_gradients: the step's first backward writes dW (each is written once per backward).
    if (rows > 0)
      blas.gemm(true, false, out, in, rows, scale, dy, ldd, x, in, overwrite_grads ? 0.0f : 1.0f, dweight, true, in,
                stream);
    else if (overwrite_grads)
      MOE_CUDA_CHECK(cudaMemsetAsync(dweight, 0, static_cast<size_t>(out * in) * sizeof(float), stream));
  }
  // linear and linear_backward for the dense projections: y = x W^T and dx = dy W through
  // `projections` (the run's precision), the weight gradient dW += dy^T x in bf16 as above.
  // x_quantised / dy_quantised: the rows' fp8 codes are in the projections' row scratch
  // (ProjectionGemms::forward_row_codes / backward_row_codes).
  void projection(bf16* y, const bf16* x, const bf16* weight, int64_t rows, int64_t in, int64_t out, bool accumulate,
                  int64_t ldy = -1, bool x_quantised = false) {
    projections->forward(y, ldy < 0 ? out : ldy, x, weight, rows, in, out, accumulate, stream, x_quantised);
  }
  void projection_backward(bf16* dx, float* dweight, const bf16* dy, const bf16* x, const bf16* weight, int64_t rows,
                           int64_t in, int64_t out, bool accumulate_dx, int64_t ld_dy = -1, bool dy_quantised = false) {
    if (dx)
      projections->backward_data(dx, dy, ld_dy < 0 ? out : ld_dy, weight, rows, in, out, accumulate_dx, stream,
                                 dy_quantised);
    linear_backward(nullptr, dweight, dy, x, weight, rows, in, out, false, ld_dy);
  }
  // The attention of a block (gpu_attention.cpp): from n1 to the output projection in
  // y [T, D]; its backward from dy to dx [T, D] (n1's gradient), accumulating the
  // projections' weight gradients.
  // n1_quantised: n1's fp8 codes are in the projections' row scratch (the norm wrote them).
  void attention_forward(Layer& layer, bf16* y, bool n1_quantised = false);
  // The width of a token's fused q|k|v row, (H + 2G) d.
  int64_t qkv_width() const { return config.qkv_width(); }
  void attention_backward(Layer& layer, bf16* dx, const bf16* dy);
  void ffn_forward(bf16* y, const bf16* x, const bf16* w1, const bf16* w3, const bf16* w2, FfnBuffers& buffers,
                   int64_t rows, int64_t F, bool accumulate);
  void ffn_backward(bf16* dx, const bf16* dy, const bf16* x, const std::array<Param, 3>& weights_, FfnBuffers& buffers,
                    int64_t rows, int64_t F, bool accumulate_dx);
  void moe_forward(Layer& layer, size_t layer_index, bool count_load);
  // The experts' GEMMs in the run's precision (gpu_moe_fp8.cpp): ExpertGemm's forward and
  // backward_data, or their fp8 versions with the operands quantised first.
  // The weights: `tensors` (sets of them) / `tensor`, Fp8ExpertWeights::Tensor values.
  // x_quantised: fp8 only, x's codes and scales are in fp8_rows already (the fused SwiGLU,
  // or the dispatch's permute);
  // dy_quantised_set >= 0: dy's are, as that set of swiglu_backward_fp8's output.
  void expert_forward(Layer& layer, const MoEBuffers& m, int sets, bf16* const* out, int64_t ld_out, const bf16* x,
                      int64_t ld_x, const int* tensors, int64_t N, int64_t K, bool x_quantised = false);
  void expert_backward_data(Layer& layer, const MoEBuffers& m, bf16* out, int64_t ld_out, const bf16* dy,
                            int64_t ld_dy, int tensor, int64_t N, int64_t K, float beta,
                            int dy_quantised_set = -1);
  // dx_rows = d gate @ W1_e + d up @ W3_e from d gate | d up [R, 2F] (bf16, or with
  // `quantised` swiglu_backward_fp8's codes in fp8_rows): two GEMMs, the second adding, or
  // with padded rows one over K = 2F (kGateUp).
  void experts_gate_up_backward_data(Layer& layer, const MoEBuffers& m, const bf16* dgate_up, bool quantised);
  // Tensor `tensor`'s copies (Fp8ExpertWeights::Tensor; kGateUp: w1 and w3 as one gate|up
  // operand) quantised into codes / scales (as stored) and codes_t / scales_t (transposed);
  // either pair may be null.
  void quantize_expert_tensor(Layer& layer, int tensor, uint8_t* codes, float* scales, uint8_t* codes_t,
                              float* scales_t);
  // The weight gradients of `sets` tensors in bf16 GEMMs: dW_e [N, K] = dy_e^T x_e, written
  // or added (overwrite_grads) into the fp32 or bf16 gradients; dy set s [R, N] (row stride
  // ld_dy), x [R, K].
  void expert_backward_weight(Layer& layer, const MoEBuffers& m, int sets, const int* tensors,
                              const bf16* const* dy, int64_t ld_dy, const bf16* x, int64_t ld_x, int64_t N, int64_t K);
  // fp8_weight_gradients, after the down projection's data gradient (d act in dact_rows):
  // SwiGLU's backward, the gate and up data gradients and all three weight gradients in
  // fp8, the GEMMs' operands from token columns (gpu_moe_fp8.cpp).
  void experts_backward_fp8_weights(Layer& layer, const MoEBuffers& m, const bf16* dy_rows);
  void set_experts(int64_t n_experts) {
    expert_gemm->set_experts(n_experts);
    if (expert_gemm_fp8) expert_gemm_fp8->set_experts(n_experts);
    if (padded_expert_gemm_fp8) padded_expert_gemm_fp8->set_experts(n_experts);
    if (padded_expert_gemm_bf16) padded_expert_gemm_bf16->set_experts(n_experts);
  }
  // Dispatch of n2 into the expert rows, the gate|up grouped GEMM (unless skipped) and
  // SwiGLU (unless skipped: the backward's SwiGLU refills act): the part of the MoE forward
  // that recompute_experts redoes before the backward.
  void expert_rows_forward(Layer& layer, bool gate_up, bool swiglu = true);
  // Dispatch of n2 into x_rows (slot_TK the routed slots); codes (fp8, a gate|up GEMM
  // follows): the dispatcher also writes x's codes into fp8_rows where it can, and then
  // this returns true (the GEMM's x_quantised).
  bool dispatch_rows(Layer& layer, const int32_t* slot_TK, bool codes);
  void experts_gate_up_gemm(Layer& layer, bool x_quantised = false);
  // swiglu_in_gemm: gate|up and act from one GEMM (PaddedExpertGemmBf16::forward_swiglu).
  void experts_gate_up_swiglu(Layer& layer);
  // swiglu_in_gemm: the down projection's data gradient with SwiGLU's backward in one kernel
  // (PaddedExpertGemmBf16::backward_data_swiglu): d gate|up into dgate_up_rows, act refilled
  // where not null; d act never written.
  void experts_down_swiglu_backward(Layer& layer, const MoEBuffers& m, const bf16* dy_rows, bf16* act);
  // The experts on rows already in x_rows: the gate|up grouped GEMM (unless skipped) and
  // SwiGLU; for_down (fp8): SwiGLU also quantises act for the down projection into
  // fp8_rows, and returns true when it did. x_quantised: as dispatch_rows returned.
  bool experts_gate_up_forward(Layer& layer, bool gate_up, bool for_down = false, bool x_quantised = false);
  int ep_rank() const { return ep ? ep->rank() : 0; }
  int64_t first_slot(const Layer& layer) const { return layer.slots.window_first(ep_rank()); }
  int64_t local_experts(const Layer& layer) const {
    return layer.slots.window_size(ep_rank());
  }
  // The local slots' rows of an expert tensor (its leading dimension is the slots).
  // Interleaved gate|up: w1's are the gate|up operand's, 2 F D elements an expert.
  const bf16* local_w(const Layer& layer, const Param& p) const {
    const int64_t per_expert = p.numel / config.moe.n_experts;
    if (!gate_up_interleaved || !layer.is_moe || p.id != layer.w3.id)
      return store->weights() + store->hi_offset(p.offset + first_slot(layer) * per_expert);
    MOE_CHECK(false, "experts: w3's bf16 weights are interleaved with w1's: read them as the gate|up operand");
    return nullptr;
  }
  float* local_g(const Layer& layer, const Param& p) {
    return g(p) + first_slot(layer) * (p.numel / config.moe.n_experts);
  }
  // The same in the bf16 gradient block (training.expert_grad_dtype = bf16; null: fp32).
  bf16* local_g16(const Layer& layer, const Param& p) {
    bf16* base = store->grads_bf16();
    return base ? base + p.offset + first_slot(layer) * (p.numel / config.moe.n_experts) : nullptr;
  }
  // Re-placement: slot s of the layer's expert tensors takes what slot source_of_slot[s]
  // holds (weights, masters' lo halves, gradients, moments), on every rank alike.
  void move_expert_slots(const Layer& layer, const std::vector<int64_t>& source_of_slot);
  // Expert parallelism, a re-placement to `next` (slot s takes what slot source_of_slot[s]
  // held): this rank's new window gathered aside (its staying experts from their old
  // slots, the arriving ones sent point to point by their old block's rank in one
  // all-to-all per tensor and block; collective over the EP group), then made resident
  // and filled. Gradients do not travel (arriving ones start
  // at zero). The caller then releases what is no longer held.
  void move_experts_between_ranks(const Layer& layer, const ExpertSlots& next, const std::vector<int64_t>& source_of_slot);
  // Host copies of the placed layers' expert tensors (tensor_of: where each one's values
  // are) from slot order into expert order (to_expert_order), or back.
  void reorder_experts(const std::function<float*(const Param&)>& tensor_of, bool to_expert_order) const;
  // Expert parallelism: the other ranks' experts into the host copies (slot order), each
  // rank's block broadcast from it into memory made resident for the time being
  // (collective over the EP group). m, v: the packed moments too (null: weights only).
  void gather_other_experts(ParameterStore<float>& params, std::vector<float>* m, std::vector<float>* v);
  // The index in `layers` of each MoE layer (the expert groups' order).
  std::vector<size_t> expert_group_layer;
  // The layer's placement on the host and the device (slot tables, windows, edge cuts).
  void set_slots(Layer& layer, ExpertSlots slots);
  // The offsets the grouped GEMMs read and the rows the row-wise kernels cover.
  const int32_t* expert_offsets(const MoEBuffers& m) const { return dispatcher->expert_offsets(m); }
  int64_t expert_rows(const MoEBuffers& m) const { return dispatcher->expert_rows(m); }
  // One block's forward: from the previous block's h and FFN output (fused residual add),
  // or from the saved input x when recomputing (and for the first layer after the embedding).
  void layer_forward(size_t l, const bf16* prev_h, const cuda::ResidualBranch& prev_branch, bool from_saved_input);
  void layer_backward(size_t l, double loss_scale);
  void check_and_upload_inputs(const int32_t* inputs_BS, const int32_t* targets_BS);
  void enqueue_forward();
  std::function<void(int)> forward_stage_hook;  // GpuTransformer::set_forward_stage_hook; not during capture
  bool capturing = false;
  ForwardResult read_forward_results();
  void enqueue_backward(double loss_scale, const std::function<void(int)>& on_stage = {});
  void moe_backward(Layer& layer, double loss_scale);
  Layer& layer_of(size_t moe_layer);  // the MoE layer `moe_layer` (0 = the first MoE block)
  Buffer<float>& balance_bias_of(size_t moe_layer);
};

}  // namespace moe
