// The GPU model's per-layer parameters and buffers (what a layer saves for its backward),
// shared by the model's source files and its expert dispatcher. Not a public interface.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/gpu.h"
#include "kernels/gpu_ops.h"
#include "moe/expert_slots.h"

namespace moe {
namespace gpu_model {

template <typename T>
using Buffer = gpu::DeviceArray<T>;

// One parameter's place in the device blocks.
struct Param {
  int id = -1;
  int64_t offset = 0, numel = 0;
};

// qkv [T, (H + 2G) d]: each token's q heads, then its k and v heads (the fused projection's
// output, RoPE applied to q and k); out [T, H d]; stats: the softmax's log-sum-exp.
struct AttentionBuffers {
  Buffer<bf16> qkv, out;
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
  // Expert parallelism (GpuModelOptions::expert_exchange; moe/token_exchange.h), kept
  // for the backward. Home side: token_pos [T, P] (each token's row in the block for each
  // rank, -1: none) and tokens_P (the block sizes). Receiving side: the received tokens'
  // routing, recv_row [U, K] (the local row of each, -1: another rank's) and recv_weight
  // [U, K]; the local rows' offsets per local slot and their received token (local_token).
  // On the host: the block sizes sent and received, and the local row count.
  Buffer<int32_t> token_pos, tokens_P, recv_row, local_offsets, local_token;
  Buffer<float> recv_weight;
  std::vector<int64_t> send_tokens_P, recv_tokens_P;
  int64_t recv_tokens = 0, local_rows = 0;
  bool fp8_rows = false;  // the exchange's rows were fp8 in the forward (parallel.a2a_compression)
  int moe_index = -1;     // the layer's (GpuExpertExchange::set_layer)
  Buffer<int32_t> slot;  // the routed experts' slots [T*K], when the layer's experts are re-placed
};

// A layer's activations inside the block, saved for its backward, or, for a layer whose
// activations are recomputed, one set shared by all such layers and refilled from the
// layer's input right before its backward.
struct Activations {
  Buffer<bf16> n1, h, n2, ffn_out;  // ffn_out: none where the combine is the next norm's
  // What the next norm adds to h: ffn_out, or the experts' rows it sums itself
  // (combine_in_next_norm; set by the layer's forward).
  cuda::ResidualBranch ffn_branch;
  Buffer<float> rstd1, rstd2;
  AttentionBuffers attn;
  FfnBuffers dense_buffers;
  MoEBuffers moe;
};

// training.precision = fp8 (docs/FP8.md): an MoE layer's local experts' weights quantised
// for the fp8 GEMMs once after they change, not at every use. Per tensor t (w1, w3, w2,
// each [E, N, K] as stored) the codes [E, N, K] with their 128 x 128 scales (the forward's
// B) and the transposed copy [E, K, N] with its scales (backward_data's B), room for
// `capacity` experts. With gate_up_joined (rows padded per expert: PaddedExpertGemmFp8)
// w1's and w3's copies are one gate|up operand each instead (fp8::gate_up_part: [E, 2F, D]
// and [E, D, 2F], in w1's and w3's room): their GEMMs run as one. Stamped with the store's
// weights_version and the slot window it was made from (GpuTransformer::State::
// fp8_expert_weights checks both).
struct Fp8ExpertWeights {
  // kGateUp: w1 and w3 as one operand (gate_up_joined only), not a stored tensor.
  enum Tensor { kW1 = 0, kW3 = 1, kW2 = 2, kTensors = 3, kGateUp = 4 };
  Buffer<uint8_t> codes;  // [copy: 0 as stored, 1 transposed][tensor][capacity * N * K]
  Buffer<float> scales;   // [copy][tensor][capacity * NB * KB]
  int64_t capacity = 0, codes_per_copy = 0, scales_per_copy = 0;
  bool gate_up_joined = false;
  uint64_t version = 0;  // 0: nothing quantised yet
  int64_t first_slot = -1, experts = -1;
  // A tensor's copy; kGateUp's (and, joined, kW1's) is the gate|up operand's start.
  uint8_t* code(int tensor, bool transposed) { return codes.data() + index(tensor, transposed) * codes_per_copy; }
  float* scale(int tensor, bool transposed) { return scales.data() + index(tensor, transposed) * scales_per_copy; }

 private:
  int64_t index(int tensor, bool transposed) const {
    // Joined, w3's room holds the second half of gate|up, not w3's copy; kGateUp only joined.
    MOE_CHECK(gate_up_joined ? tensor != kW3 : tensor != kGateUp, "fp8 expert weights: tensor {} with gate|up {}",
              tensor, gate_up_joined ? "joined" : "apart");
    return int64_t{transposed} * kTensors + (tensor == kGateUp ? kW1 : tensor);
  }
};

struct Layer {
  Param norm1, norm2, wq, wk, wv, wo;
  Param router_w, router_b, w1, w3, w2;              // MoE layers
  std::vector<std::array<Param, 3>> shared;          // shared experts: w1, w3, w2
  std::array<Param, 3> dense;                        // dense FFN layers: w1, w3, w2
  bool is_moe = false;
  int moe_index = -1;  // among the MoE layers (0: the first MoE block); -1: a dense layer
  bool recompute = false;  // activations recomputed in the backward
  // The expert rows shared with the other MoE layers and refilled before the backward
  // (GpuModelOptions::recompute_experts and recompute_experts_layers).
  bool recompute_expert_rows = false;
  Buffer<bf16> x;          // the layer's input (the residual stream), always kept
  std::shared_ptr<Activations> act;
  Buffer<int64_t> load;  // assignments per slot since reset
  Buffer<double> routing;  // since reset: kept rows per expert (E), router entropy sum, tokens
  Buffer<float> balance_bias;  // moe.bias_balancing's selection bias (set_balance_bias)
  Buffer<int32_t> route_choices;  // moe.route_cache: the last forward's top-k [T*K], past recompute's reuse of act
  Buffer<float> router_temperature;  // 1 float the router kernels read (set_router_temperature)
  // Expert placement (place_experts), the value moe/expert_slots.h describes: slot s of
  // the expert tensors (w1, w3, w2: weights, gradients, moments) holds expert
  // slots.expert_of_slot[s]; EP rank p computes its window of slots. The router picks
  // experts; when `placed` (not the identity), slot_of_expert turns them into slots before
  // the rows are laid out, so everything after it (row layout, exchange, grouped GEMMs)
  // works on slots.
  ExpertSlots slots;
  // On the device: first_slot_P1, window_end_P, and the block edges as boundary cuts.
  Buffer<int32_t> slot_of_expert, first_slot, window_end, edge_cut;
  bool placed = false;
  Fp8ExpertWeights fp8;  // training.precision = fp8 with the weight cache (MoE layers)
};

}  // namespace gpu_model

}  // namespace moe
