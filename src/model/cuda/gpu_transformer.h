// The MoE transformer on one GPU: bf16 activations and weights for the matmuls, fp32
// master weights (kept as the bf16 weights plus a 16-bit remainder), fp32 gradients,
// AdamW moments in fp32 or bf16, fp32 router math and loss. The same
// architecture, parameter names and layout as Transformer<float> (the CPU reference it
// is tested against); every op is a tested kernel from kernels/, moe/ and optim/gpu_ops.h.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/model_config.h"
#include "core/range.h"
#include "model/expert_layout.h"
#include "config/training_config.h"
#include "model/cuda/gpu_parameters.h"
#include "model/parameters.h"
#include "model/transformer.h"
#include "moe/routing_cache.h"
#include "moe/speculative_exchange.h"

namespace moe {

namespace gpu {
class PhaseClock;
}

// Expert parallelism for the GPU model (GpuModelOptions::expert_exchange): EP rank p of P computes
// experts [p * E/P, (p + 1) * E/P) for the tokens of all P ranks. Implemented over NCCL in
// src/dist/cuda/gpu_expert_exchange.h; tests use a one-rank copy.
class GpuExpertExchange {
 public:
  virtual ~GpuExpertExchange() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // The model's CUDA stream (a cudaStream_t): each exchange starts after the work enqueued
  // on it so far, and the work enqueued after the call waits for the exchange.
  virtual void set_stream(void* stream) = 0;
  // All-to-all of device buffers packed by EP peer; counts in elements of elem_bytes bytes
  // (2: bf16 rows, 4: int32 counts). Collective over the EP group.
  virtual void exchange(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                        const std::vector<int64_t>& recv_counts, size_t elem_bytes) = 0;
  // `bytes` of device memory from EP rank `root` to the others, ordered on the stream.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  // parallel.a2a_compression: which MoE layers' token rows travel as fp8 e4m3 rows with a
  // per-row scale (core/fp8.h), both ways, forward and backward; read at each layer's
  // dispatch, kept for its backward. set_fp8: every layer (none / fp8), before the model
  // is built. allow_fp8: room for fp8 rows with the layers set one by one (auto), by
  // set_layer_fp8 between steps, the same on every EP rank.
  void set_fp8(bool on) {
    all_fp8_ = on;
    fp8_capable_ = fp8_capable_ || on;
    layer_fp8_.clear();
  }
  void allow_fp8() { fp8_capable_ = true; }
  void set_layer_fp8(int moe_layer, bool on) {
    if (layer_fp8_.size() <= static_cast<size_t>(moe_layer)) layer_fp8_.resize(static_cast<size_t>(moe_layer) + 1, all_fp8_);
    layer_fp8_[static_cast<size_t>(moe_layer)] = on;
  }
  bool fp8(int moe_layer) const {
    return moe_layer >= 0 && static_cast<size_t>(moe_layer) < layer_fp8_.size() ? layer_fp8_[static_cast<size_t>(moe_layer)] != 0
                                                                                  : all_fp8_;
  }
  bool fp8_capable() const { return fp8_capable_; }
  // The MoE layer the next exchanges belong to (-1: none), for per-layer timing.
  virtual void set_layer(int moe_layer) { (void)moe_layer; }

 private:
  bool all_fp8_ = false, fp8_capable_ = false;
  std::vector<char> layer_fp8_;
};

struct GpuRoutingStats {
  std::vector<std::vector<int64_t>> load, kept;  // [MoE layer][expert]
  std::vector<double> entropy_sum;               // nats, summed over tokens
  std::vector<int64_t> tokens;
  // Expert parallelism, per MoE layer: the speculative dispatch's rows (this rank's
  // received: used, wasted, corrected) and the seconds the forward dispatches added to
  // the model's stream from the router's end to the expert rows in place.
  std::vector<SpeculationRows> speculation;
  std::vector<double> dispatch_wait_s;
};

// What a GpuTransformer is built to do (fixed for its life; training.* and parallel.*).
struct GpuModelOptions {
  // optimizer.state_dtype: the AdamW moments' storage.
  MomentDtype moments = MomentDtype::Fp32;
  // training.expert_grad_dtype = bf16: the expert tensors' gradients in bf16 (the grouped
  // weight-gradient GEMMs accumulate in fp32 and round once per micro-batch). One rank.
  bool bf16_expert_grads = false;
  // Activation recomputation: the first `recompute_layers` blocks (-1: all) keep only
  // their input; their activations live in one buffer set shared by them and are
  // recomputed from that input right before each one's backward (bit-identical: every
  // kernel is deterministic).
  int64_t recompute_layers = 0;
  // Selective recomputation inside the MoE layers (see ExpertRecompute; bit-identical), in
  // the first `recompute_experts_layers` MoE layers (-1: all); the later ones keep their
  // expert rows, which saves their refill in the backward where memory allows.
  ExpertRecompute recompute_experts = ExpertRecompute::None;
  int64_t recompute_experts_layers = -1;
  // How cuDNN's attention backward sums dQ: in a fixed order (Workspace, Ordered), so reruns
  // are bit-identical (the one kernel that needs a switch; everything else is deterministic
  // by construction), or by its faster atomics (Atomic). training.deterministic and
  // deterministic_attention.
  AttentionDq attention_dq = AttentionDq::Workspace;
  // The attention backward in this many query blocks (training.attention_query_chunks).
  int64_t attention_query_chunks = 1;
  // Expert parallelism over `expert_exchange` (null: off). Every rank keeps the block
  // layout of all the parameters but memory (weights, gradients, moments) only for the
  // non-expert ones and its own experts (its window; GpuParameterStore's resident ranges),
  // and computes its experts on the rows every EP rank routes to them: one host
  // synchronisation per MoE layer and pass for the row counts, so no CUDA graphs, and
  // recompute_experts must be none. The trainer sums the shared gradients over all ranks
  // and its experts' over the ranks holding them.
  std::shared_ptr<GpuExpertExchange> expert_exchange;
  // At most this many experts per EP rank in any placement, its window with split
  // experts (0: E / P, + 1 with split experts: equal blocks only); sizes the buffers and
  // grouped GEMMs (expert parallelism's load balancing; gpu_placement.cpp).
  int64_t max_local_experts = 0;
  // Split experts (parallel.split_experts): each EP rank also holds the first expert of
  // the next rank's block (a hinge), and every micro-batch moves each boundary inside its
  // hinge so that all ranks compute the same number of rows (moe/token_exchange.h). A
  // hinge's gradient is then the sum of its two holders' (sum those over all
  // ranks: hinge_ranges in model/expert_layout.h), and both step it.
  bool split_experts = false;
  // training.precision = fp8: the experts' forward and data-gradient GEMMs in fp8 with
  // blockwise scales (docs/FP8.md); model.dim and moe.expert_hidden multiples of 128.
  bool fp8_experts = false;
  // training.precision = fp8: the dense projections' forward and data-gradient GEMMs too
  // (attention's q|k|v and output, the dense FFN and shared experts), each whose shape the
  // dense FP8 GEMM takes (fp8::dense_gemm_fits; the others bf16; docs/FP8.md).
  bool fp8_projections = false;
  // With fp8_experts: each MoE layer keeps its local experts' weights quantised (both
  // layouts: 2 bytes per local expert parameter), made once after the weights change
  // instead of before every GEMM (training.fp8_weight_cache). The same bits either way.
  bool fp8_weight_cache = true;
  // With fp8_experts: the experts' weight-gradient GEMMs in fp8 too (each expert's rows of
  // dy and x transposed to token columns, one scale per feature and 128 tokens; docs/FP8.md;
  // training.fp8_weight_gradients).
  bool fp8_weight_gradients = false;
  // With fp8_weight_gradients: the scales of x's and act's token columns (the GEMMs' B;
  // training.fp8_weight_gradient_scales).
  Fp8ColumnScales fp8_weight_gradient_scales = Fp8ColumnScales::Tile1x128;
  // With fp8_experts: DeepGEMM's kernel (training.fp8_gemm_backend = deepgemm; no expert
  // exchange; cuda::deepgemm_available()) for the experts' forward and data-gradient GEMMs,
  // over rows padded per expert to 128, and for the fp8 projections' GEMMs that do not
  // accumulate while no multiprocessors are reserved.
  bool fp8_deepgemm = false;
  // Without fp8_experts: DeepGEMM's bf16 kernel (training.bf16_gemm_backend = deepgemm; no
  // expert exchange) for the experts' GEMMs over rows padded per expert to 128: the forward
  // and data gradients always, the weight gradients where they are bf16 and written (the
  // step's first micro-batch) and the experts few (PaddedExpertGemmBf16::kWeightGradientExperts).
  bool bf16_deepgemm = false;
  // With bf16_deepgemm (training.interleave_gate_up): each MoE layer's w1 and w3 kept
  // expert by expert in the bf16 weights (GpuParameterStore::interleave_hi), so the gate|up
  // GEMM runs as one launch each way (N = 2F forward, K = 2F data gradient: one rounding of
  // dx instead of two). Off where the store cannot (ZeRO's hi gathers; the trainer turns it
  // off there) or an expert's F x D is not a multiple of adamw_math::kNormChunk.
  bool interleave_gate_up = false;
  // With gate|up interleaved and moe.expert_hidden a multiple of 128 (training.swiglu_in_gemm):
  // the forward's act from the gate|up GEMM's epilogue (PaddedExpertGemmBf16::forward_swiglu)
  // and SwiGLU's backward in the down projection's data gradient (backward_data_swiglu): our
  // own kernels, the same bits, no SwiGLU pass and no d act written.
  bool swiglu_in_gemm = false;
  // What training.* sets (precision, expert gradients, recomputation, determinism) and the
  // moments' dtype; the caller adds the exchange and placement.
  static GpuModelOptions from_config(const TrainingConfig& training, MomentDtype moments);
};

class GpuTransformer {
 public:
  // Copies the (already initialised) parameters of `params` to the device.
  GpuTransformer(const ModelConfig& config, const ParameterStore<float>& params, const GpuModelOptions& options = {});
  ~GpuTransformer();
  GpuTransformer(const GpuTransformer&) = delete;
  GpuTransformer& operator=(const GpuTransformer&) = delete;

  // Allocates every activation and scratch buffer for micro-batches of `batch` sequences.
  void plan(int64_t batch);
  // Token ids on the host, [batch, seq_len]; targets of -1 are ignored.
  ForwardResult forward(const int32_t* inputs_BS, const int32_t* targets_BS);
  // Called on the host right before each stage's forward work is enqueued (the backward's
  // stage numbers: n_layers + 1 the embedding first, ..., 0 the final norm and LM head),
  // e.g. to make the stream wait for that stage's weights (ZeRO-1's all-gathers). Not
  // called while a CUDA graph is captured, nor by recomputation. Empty: none.
  void set_forward_stage_hook(std::function<void(int stage)> hook);
  // Backward of (ce + aux + z) * loss_scale, accumulated into the fp32 gradients.
  // `on_stage`, when given, is called on the host right after each backward stage's work
  // is enqueued (Transformer::backward_stage_of's numbering: 0 the LM head and final norm,
  // 1 + i block n_layers - 1 - i, n_layers + 1 the embedding), so that a reduction of the
  // gradients that stage completed can start on another stream while the rest runs.
  void backward(double loss_scale, const std::function<void(int stage)>& on_stage = {});
  // forward then backward(loss_scale) of one micro-batch. With graphs enabled, the work
  // is captured once as a CUDA graph and replayed (re-captured when the number of valid
  // targets or the loss scale changes: both are kernel arguments). Shapes are static in
  // both routing modes (no host synchronisation inside the step), so this always applies.
  ForwardResult forward_backward(const int32_t* inputs_BS, const int32_t* targets_BS, double loss_scale);
  // Starts a step's gradients without a zeroing pass over what GEMMs compute: zeroes every
  // other resident gradient (parameters().zero_grads(written)) and makes the next backward
  // write the dense projections' and this rank's experts' weight gradients (GEMMs with beta
  // 0, experts without rows zeroed on the device) instead of adding to them. The same
  // gradients as parameters().zero_grads() then the backward, bit for bit (0 + x = x; a
  // GEMM's sum starts from +0 and is never -0); later backwards add as before.
  void begin_gradients();
  void enable_graphs(bool enabled);
  // Leaves `sms` multiprocessors free of the GEMMs (0: none), from now until the next
  // call. The grouped GEMMs are persistent and cuBLASLt's Hopper kernels may be: while
  // they run, NCCL's kernels on another stream get no SM, so a gradient all-reduce meant
  // to overlap the backward waits for gaps between kernels instead. Takes effect at once.
  void reserve_sms(int sms);
  // Re-places every MoE layer's experts: experts_of_rank_by_layer[l][p] lists the experts
  // EP rank p computes in MoE layer l (over one rank without expert parallelism), each
  // expert once, at most the maximum above per rank, none also allowed. Every rank must
  // pass the same placement (collective under expert parallelism: each expert changing
  // ranks is first sent from its holder, then weights, lo halves, gradients and moments
  // move to their slots on every rank; call it between steps, as gradients do not travel).
  // Results stay bit-identical (up to the split of a token's partial combines over the
  // ranks with top-k > 1, and the hinges' row shares with split experts); host copies
  // (download_*, upload_state, routing().stats(); to_expert_order in model/expert_layout.h)
  // stay in expert order. Not
  // with a sharded optimizer. Waits.
  void place_experts(const std::vector<std::vector<std::vector<int64_t>>>& experts_of_rank_by_layer);
  // Each MoE layer's placement (equal blocks at first) and expert tensors: the ranges this
  // rank's gradients and optimizer cover and per-slot values' expert order are functions
  // of it (model/expert_layout.h).
  ExpertLayout expert_layout() const;
  // The parameter blocks (weights, gradients, optimizer state; stepped by a GpuOptimizer,
  // optim/cuda/gpu_optimizer.h) and the CUDA stream all work is ordered on (a
  // cudaStream_t), for data-parallel gradient reduction.
  GpuParameterStore& parameters();
  void* stream() const;
  // GpuModelOptions::swiglu_in_gemm in effect: SwiGLU in the gate|up GEMM, its backward in the
  // down projection's data gradient.
  bool swiglu_in_gemm() const;
  // Device -> host copies for tests, checkpoints and exports, in expert order. Under expert
  // parallelism a rank keeps memory for its own experts only (its window; the others'
  // offsets stay in the block but hold nothing): download_grads copies what this rank
  // holds; download_params and download_state are collective over the EP group, each
  // other expert coming from its holder (one rank's block of one tensor at a time).
  void download_grads(ParameterStore<float>& params) const;
  void download_params(ParameterStore<float>& params);
  // Expert parallelism with ZeRO (the store packed: no other expert can be made resident):
  // each EP rank's experts, already in its host copy, broadcast to the other EP ranks'
  // host copies through a device staging buffer. Not after a re-placement. Collective.
  void share_expert_values(ParameterStore<float>& params);
  // The whole training state for checkpoints: parameters into `params`, and the AdamW
  // moments in the CPU AdamW's packed layout (parameter after parameter, no padding).
  void download_state(ParameterStore<float>& params, std::vector<float>& m, std::vector<float>& v);
  // The reverse (every rank passes the whole state; each keeps what it holds).
  void upload_state(const ParameterStore<float>& params, const std::vector<float>& m, const std::vector<float>& v);
  // The routers' state and counters, every MoE layer's (model/cuda/gpu_moe.cpp).
  class Routing;
  Routing& routing();
  // Marks the phases of its work (model/cuda/gpu_phases.h) on `clock` (null: none).
  void set_phase_clock(gpu::PhaseClock* clock);

 private:
  struct State;
  std::unique_ptr<State> state_;
  std::unique_ptr<Routing> routing_;
};

// GpuTransformer::routing(): what the trainer reads and sets between steps about the routers.
class GpuTransformer::Routing {
 public:
  // Routing since the last reset_stats(), per MoE layer, in expert order: assignments
  // before and rows kept after capacity, router entropy and tokens (this rank's tokens:
  // under expert parallelism the home rank's). Counted on the device in the forwards, read
  // here with one synchronisation.
  GpuRoutingStats stats();
  void reset_stats();
  // The aux-loss-free balancing bias of MoE layer `moe_layer` (0 = the first MoE block),
  // E values added to the scores for the top-k choice only, as MoELayer::balance_bias_E()
  // on the CPU. Read by the forward when moe.bias_balancing is on; starts at zero. The
  // host keeps the master copy (the CPU's bias_balance_update runs there) and uploads it.
  void set_balance_bias(size_t moe_layer, const std::vector<float>& bias_E);
  std::vector<float> balance_bias(size_t moe_layer) const;
  // The last forward's top-k choices of every MoE layer, [tokens, top_k] each (downloaded
  // with one synchronisation: moe.route_cache's probe, off by default).
  std::vector<std::vector<int32_t>> expert_choices();
  // moe.speculative_dispatch (expert parallelism, docs/ROUTING_CACHE.md): predictors[i]
  // guesses MoE layer i + 1's experts from layer i's (null: none), read on the host in the
  // forwards while set_speculating(true) (training forwards; recomputed ones never guess).
  void set_predictors(std::vector<const RoutingCache*> predictors);
  void set_speculating(bool on);
  // The router temperature of MoE layer `moe_layer`, kept on the device and read by the
  // router kernels (so graph replays see a new value); starts at moe.temperature. The
  // host's MoELayer::temperature() is the master copy (moe.temperature_control).
  void set_temperature(size_t moe_layer, float temperature);
  float temperature(size_t moe_layer) const;

 private:
  friend class GpuTransformer;
  explicit Routing(State& state) : s_(state) {}
  State& s_;
};

}  // namespace moe
