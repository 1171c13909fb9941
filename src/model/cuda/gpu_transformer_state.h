// The GPU model's private state, shared by its two source files: gpu_transformer.cpp (the
// step, planning, parameters) and gpu_moe.cpp (the MoE layer: router, dispatch, experts,
// balancing and per-expert clipping). Not part of the public interface.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda/phase_clock.h"
#include "core/gpu.h"
#include "kernels/gpu_ops.h"
#include "model/cuda/gpu_phases.h"
#include "model/cuda/gpu_transformer.h"

namespace moe {
namespace gpu_model {

template <typename T>
using Buffer = gpu::DeviceArray<T>;

// One parameter's place in the device blocks.
struct Param {
  int id = -1;
  int64_t offset = 0, numel = 0;
};

struct AttentionBuffers {
  Buffer<bf16> q, k, v, out;
  Buffer<float> stats;
};

// A SwiGLU FFN's saved activations: [rows, 2F] gate|up and [rows, F] act.
struct FfnBuffers {
  Buffer<bf16> gate_up, act;
};

// The experts' input rows [R, D], gate|up [R, 2F] and SwiGLU activation [R, F]: 69% of an
// MoE layer's saved bytes (mixtral-mini). Each is kept per layer or, when recomputed
// (ExpertRecompute), one buffer shared by the MoE layers and refilled from the layer's n2
// right before its backward.
using SharedRows = std::shared_ptr<Buffer<bf16>>;

struct MoEBuffers {
  Buffer<float> logits, scores, weight, aux_term, z_term;
  Buffer<int32_t> expert, row, counts, assign_counts, offsets, token_of_row, rank;
  SharedRows x_rows, gate_up_rows, act_rows;
  Buffer<bf16> y_rows;
  std::vector<FfnBuffers> shared;
  // Expert parallelism (set_expert_exchange; the exchange of moe/token_exchange.h), kept
  // for the backward. Home side: token_pos [T, P] (each token's row in the block for each
  // rank, -1: none) and tokens_P (the block sizes). Receiving side: the received tokens'
  // routing, recv_row [U, K] (the local row of each, -1: another rank's) and recv_weight
  // [U, K]; the local rows' offsets per local slot and their received token (local_token).
  // On the host: the block sizes sent and received, and the local row count.
  Buffer<int32_t> token_pos, tokens_P, recv_row, local_offsets, local_token;
  Buffer<float> recv_weight;
  std::vector<int64_t> send_tokens_P, recv_tokens_P;
  int64_t recv_tokens = 0, local_rows = 0;
  Buffer<int32_t> slot;  // the routed experts' slots [T*K], when the layer's experts are re-placed
};

// A layer's activations inside the block, saved for its backward, or, for a layer whose
// activations are recomputed, one set shared by all such layers and refilled from the
// layer's input right before its backward.
struct Activations {
  Buffer<bf16> n1, h, n2, ffn_out;
  Buffer<float> rstd1, rstd2;
  AttentionBuffers attn;
  FfnBuffers dense_buffers;
  MoEBuffers moe;
};

struct Layer {
  Param norm1, norm2, wq, wk, wv, wo;
  Param router_w, router_b, w1, w3, w2;              // MoE layers
  std::vector<std::array<Param, 3>> shared;          // shared experts: w1, w3, w2
  std::array<Param, 3> dense;                        // dense FFN layers: w1, w3, w2
  bool is_moe = false;
  bool recompute = false;  // activations recomputed in the backward
  Buffer<bf16> x;          // the layer's input (the residual stream), always kept
  std::shared_ptr<Activations> act;
  Buffer<int64_t> load;  // assignments per slot since reset
  Buffer<double> routing;  // since reset: kept rows per expert (E), router entropy sum, tokens
  Buffer<float> balance_bias;  // moe.bias_balancing's selection bias (set_balance_bias)
  // Expert placement (place_experts): slot s of the expert tensors (w1, w3, w2: weights,
  // gradients, moments) holds expert expert_of_slot[s]; EP rank p's block is the slots
  // [first_slot_P1[p], first_slot_P1[p + 1]) and it computes its window [first_slot_P1[p],
  // window_end_P[p]): the block, and with split experts the next block's first slot too
  // (moe/token_exchange.h). The router picks experts; when `placed` (not the identity),
  // slot_of_expert turns them into slots before the rows are laid out, so everything after
  // it (row layout, exchange, grouped GEMMs) works on slots.
  std::vector<int64_t> expert_of_slot, first_slot_P1, window_end_P;
  // On the device: first_slot_P1, window_end_P, and the block edges as boundary cuts.
  Buffer<int32_t> slot_of_expert, first_slot, window_end, edge_cut;
  bool placed = false;
};

}  // namespace gpu_model

// Only gpu_transformer.cpp and gpu_moe.cpp include this header.
using namespace gpu_model;  // NOLINT(google-build-using-namespace)

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
  // Expert parallelism (set_expert_exchange): this rank computes each MoE layer's slots
  // [first_slot_P1[rank], first_slot_P1[rank + 1]) (Layer); without it, all of them.
  // max_local_experts bounds a rank's count (set_max_local_experts; the plan's buffers and
  // the grouped GEMMs are sized for it), max_local_rows the rows it may compute. Scratch
  // of the exchange, sized for P * T tokens (every rank's whole micro-batch): ep_send and
  // ep_recv the token rows, the routing sent and received, the combine weights'
  // gradients on both sides, the counts sent and received (brought back through the
  // pinned ep_host_counts).
  std::shared_ptr<GpuExpertExchange> ep;
  int64_t max_local_experts = 0, max_local_rows = 0, max_exchange_tokens = 0;
  int64_t local_experts_cap = 0;  // set_max_local_experts (0: E / P, + 1 with split experts)
  // set_split_experts: each block's first slot is shared with the rank before it, and every
  // micro-batch's cuts even the ranks' rows (the kept rows per slot gathered from all).
  bool split_experts = false;
  Buffer<bf16> ep_send, ep_recv;
  Buffer<int32_t> ep_slot_send, ep_slot_recv, ep_rank_scratch, ep_local_counts, ep_counts_send, ep_counts_recv;
  Buffer<int32_t> ep_rank_TK, ep_cut, ep_all_counts_send, ep_all_counts;  // route_ranks, boundary_cuts
  Buffer<float> ep_weight_send, ep_dweight_local, ep_dweight_home;
  int32_t* ep_host_counts = nullptr;  // E + 2P counts sent, then P * (max_local_experts + 1) received
  cudaStream_t stream = nullptr;
  int64_t batch = 0, tokens = 0;
  int compute_sm_limit = 0;  // multiprocessors the GEMMs launch on (0: all); see reserve_sms
  int64_t recompute_layers = 0;  // the first N layers recompute their activations (-1: all)
  bool recomputing = false;      // inside a backward's recomputed forward
  ExpertRecompute recompute_experts = ExpertRecompute::None;
  // CUDA graph of zero_grads + forward + backward of one micro-batch, replayed while the
  // values baked into its kernel arguments (valid targets, loss scale) stay the same.
  bool graphs = false;
  cudaGraphExec_t graph = nullptr;
  int64_t graph_n_valid = -1;
  bool graph_warm = false;  // an eager step has run since plan()
  double graph_loss_scale = 0;
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
  Buffer<bf16> dlogits_head;
  int64_t head_chunk_rows = 0;
  Buffer<float> final_rstd, loss;
  // Device-side results of a forward, read back once at its end: [0] cross-entropy,
  // then per layer aux and z loss terms; kept rows per layer (offsets[E]).
  Buffer<float> sums;
  Buffer<int32_t> kept_rows;
  Buffer<double> routing_scratch;  // accumulate_routing_stats' per-block partial entropies
  // Backward scratch.
  Buffer<bf16> dres, dnorm, dq, dk, dv, dattn, drows, dact_rows, dgate_up_rows, dx_rows, dlogits_bf16, dffn_act,
      dffn_gate_up;
  Buffer<float> dweight, dlogits, norm_partial;
  Buffer<char> embedding_scratch;
  int64_t n_valid = 0;
  ~State() {
    if (graph) cudaGraphExecDestroy(graph);
    if (stream) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    free_ep_host();
  }
  gpu::PhaseClock* clock = nullptr;  // set_phase_clock
  // No events inside a captured CUDA graph.
  void mark(int phase) {
    if (clock && !capturing) clock->mark(phase, stream);
  }
  void free_ep_host() {
    if (ep_host_counts) cudaFreeHost(ep_host_counts);
    ep_host_counts = nullptr;
  }
  const bf16* w(const Param& p) const { return store->weights() + p.offset; }
  float* g(const Param& p) { return store->grads() + p.offset; }
  // fp32 values, for the parameters read in fp32 (the router biases; see the constructor).
  const float* w32(const Param& p) const { return store->fp32_values(p.id); }

  // y[rows, out] = x[rows, in] @ W^T (+ y when accumulate).
  void linear(bf16* y, const bf16* x, const bf16* weight, int64_t rows, int64_t in, int64_t out, bool accumulate,
              int64_t ldy = -1) {
    blas.gemm(false, true, rows, out, in, 1.0f, x, in, weight, in, accumulate ? 1.0f : 0.0f, y, false,
              ldy < 0 ? out : ldy, stream);
  }
  // dx[rows, in] = scale * dy[rows, out] @ W (+ dx when accumulate); dW[out, in] += scale * dy^T @ x.
  void linear_backward(bf16* dx, float* dweight, const bf16* dy, const bf16* x, const bf16* weight, int64_t rows,
                       int64_t in, int64_t out, bool accumulate_dx, int64_t ld_dy = -1, float scale = 1.0f) {
    const int64_t ldd = ld_dy < 0 ? out : ld_dy;
    if (dx) blas.gemm(false, false, rows, in, out, scale, dy, ldd, weight, in, accumulate_dx ? 1.0f : 0.0f, dx, false, in, stream);
    if (rows > 0) blas.gemm(true, false, out, in, rows, scale, dy, ldd, x, in, 1.0f, dweight, true, in, stream);
  }
  void ffn_forward(bf16* y, const bf16* x, const bf16* w1, const bf16* w3, const bf16* w2, FfnBuffers& buffers,
                   int64_t rows, int64_t F, bool accumulate);
  void ffn_backward(bf16* dx, const bf16* dy, const bf16* x, const std::array<Param, 3>& weights_, FfnBuffers& buffers,
                    int64_t rows, int64_t F, bool accumulate_dx);
  void moe_forward(Layer& layer, size_t layer_index, bool count_load);
  // Dispatch of n2 into the expert rows, the gate|up grouped GEMM (unless skipped) and
  // SwiGLU: the part of the MoE forward that recompute_experts redoes before the backward.
  void expert_rows_forward(Layer& layer, bool gate_up);
  // The experts on rows already in x_rows: the gate|up grouped GEMM (unless skipped) and SwiGLU.
  void experts_gate_up_forward(Layer& layer, bool gate_up);
  // Expert parallelism: each token once to every rank computing one of its experts, the
  // experts there, one partial combine per token back, the sum into ffn_out; and the
  // backward's mirror image in two halves around the experts' GEMMs (from the output
  // gradient dy to drows; from dx_rows to dnorm and dweight).
  void ep_experts_forward(Layer& layer, const int32_t* slot_TK);
  void ep_combine_backward(Layer& layer, const bf16* dy);
  void ep_dispatch_backward(Layer& layer);
  // `count` elements of elem_bytes per token of the blocks, out and back.
  void exchange_tokens(const void* send, const std::vector<int64_t>& send_tokens_P, void* recv,
                       const std::vector<int64_t>& recv_tokens_P, int64_t per_token, size_t elem_bytes);
  // Expert parallelism: the token blocks for each rank, the counts exchanged (kept rows per
  // slot and block sizes), the one host wait per MoE layer and forward for them.
  void plan_expert_exchange(Layer& layer, const int32_t* slot_TK);
  int ep_rank() const { return ep ? ep->rank() : 0; }
  int64_t first_slot(const Layer& layer) const { return layer.first_slot_P1[static_cast<size_t>(ep_rank())]; }
  int64_t local_experts(const Layer& layer) const {
    return layer.window_end_P[static_cast<size_t>(ep_rank())] - first_slot(layer);
  }
  // The local slots' rows of an expert tensor (its leading dimension is the slots).
  const bf16* local_w(const Layer& layer, const Param& p) const {
    return w(p) + first_slot(layer) * (p.numel / config.moe.n_experts);
  }
  float* local_g(const Layer& layer, const Param& p) {
    return g(p) + first_slot(layer) * (p.numel / config.moe.n_experts);
  }
  // Re-placement: slot s of the layer's expert tensors takes what slot source_of_slot[s]
  // holds (weights, masters' lo halves, gradients, moments), on every rank alike.
  void move_expert_slots(const Layer& layer, const std::vector<int64_t>& source_of_slot);
  // Expert parallelism, before a re-placement: each expert whose EP rank changes is sent
  // from its holder to the others (collective over the EP group).
  void send_moving_experts(const Layer& layer, const std::vector<int64_t>& new_first_slot_P1,
                           const std::vector<int64_t>& new_order);
  // Host copies of the placed layers' expert tensors (tensor_of: where each one's values
  // are) from slot order into expert order.
  void slots_to_experts(const std::function<float*(const Param&)>& tensor_of) const;
  // The index in `layers` of each MoE layer (the expert groups' order).
  std::vector<size_t> expert_group_layer;
  void reset_placement(Layer& layer, int P);
  // Sets the layer's slot bounds, windows and edge cuts on the host and the device.
  void set_slot_bounds(Layer& layer, std::vector<int64_t> first_slot_P1);
  // The EP ranks whose windows hold each slot, under block bounds first_slot_P1.
  std::vector<std::vector<int>> slot_holders(const std::vector<int64_t>& first_slot_P1) const;
  // The offsets the grouped GEMMs read and the rows the row-wise kernels cover.
  const int32_t* expert_offsets(const MoEBuffers& m) const { return ep ? m.local_offsets.data() : m.offsets.data(); }
  int64_t expert_rows(const MoEBuffers& m) const { return ep ? m.local_rows : max_rows; }
  // One block's forward: from the previous block's h and FFN output (fused residual add),
  // or from the saved input x when recomputing (and for the first layer after the embedding).
  void layer_forward(size_t l, const bf16* prev_h, const bf16* prev_branch, bool from_saved_input);
  void layer_backward(size_t l, double loss_scale);
  void check_and_upload_inputs(const int32_t* inputs_BS, const int32_t* targets_BS);
  void enqueue_forward();
  std::function<void(int)> forward_stage_hook;  // GpuTransformer::set_forward_stage_hook; not during capture
  bool capturing = false;
  ForwardResult read_forward_results();
  void enqueue_backward(double loss_scale, const std::function<void(int)>& on_stage = {});
  void moe_backward(Layer& layer, double loss_scale);
  Buffer<float>& balance_bias_of(size_t moe_layer);
};

}  // namespace moe
