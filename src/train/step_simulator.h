// A step-time model for N GPUs in nodes of G: per-phase compute (from a measured compute
// profile or the hardware's peaks), the expert-parallel all-to-all (flat or hierarchical),
// the data-parallel gradient reduction overlapped with the backward, ZeRO's gathers, and
// the optimizer. Pure arithmetic: no I/O (the files are read by train/hardware_description.h).
// The model, its assumptions and its calibration: docs/SIMULATOR.md.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "config/parallel_config.h"
#include "config/run_config.h"

namespace moe {

// Compute and links of one kind of node (configs/hardware/*.toml).
struct HardwareDescription {
  std::string name;
  int64_t gpus_per_node = 8;       // most GPUs one node holds
  double peak_tflops = 0;          // dense bf16 per GPU
  double hbm_tb_s = 0;             // memory bandwidth per GPU
  double matmul_efficiency = 0;    // fraction of peak the GEMM phases reach (without a profile)
  double memory_efficiency = 0;    // fraction of hbm_tb_s the memory-bound phases reach (without a profile)
  double overlap_slowdown = 0;     // compute time lost per ms of communication running beside it (SMs, memory)
  double intra_bandwidth_gb_s = 0; // per GPU, one direction, inside a node
  double intra_efficiency = 0;     // fraction of it NCCL reaches
  double intra_latency_us = 0;     // per message
  int64_t nics_per_node = 0;
  double nic_gbit_s = 0;           // per NIC, one direction
  double inter_efficiency = 0;     // fraction of the NICs' line rate reached
  double inter_latency_us = 0;     // per message

  // Achieved bytes per second: one GPU over the intra-node links, and one GPU's share of
  // its node's NICs (every GPU of the node sends at once).
  double intra_bytes_per_s() const { return intra_bandwidth_gb_s * 1e9 * intra_efficiency; }
  double nic_bytes_per_s_per_gpu(int64_t gpus_in_node) const {
    return static_cast<double>(nics_per_node) * nic_gbit_s / 8.0 * 1e9 * inter_efficiency /
           static_cast<double>(gpus_in_node);
  }
};

// What a measured `moe bench --json` run gives: its model's shape and the mean ms per step
// of each phase (gpu_phase_names), on a GPU of peak_tflops and hbm_tb_s.
struct ComputeProfile {
  std::string source;              // what produced it (device, commit, config)
  double peak_tflops = 0;
  double hbm_tb_s = 0;
  RunConfig config;                // the bench model (model, training.micro_batch, optimizer.state_dtype)
  std::map<std::string, double> phase_ms;
};

// The work of one rank's micro-batch (forward + backward), per compute category; units are
// FLOPs for the GEMM categories, elements moved for `memory`, parameters for `optimizer`.
struct StepWork {
  double attention_flops = 0;  // QKV/O projections + attention scores and values
  double expert_flops = 0;     // routed (top_k) and shared experts' SwiGLU GEMMs
  double dense_flops = 0;      // the first_dense_layers' FFNs
  double lm_head_flops = 0;
  double memory_elements = 0;  // norms, router, dispatch/combine rows: tokens x dim x (layers + moe layers x top_k)
};
StepWork micro_batch_work(const ModelConfig& mc, int64_t tokens);

// Parameters by where they live: the experts' (split over EP) and the rest (replicated).
struct ParameterSplit {
  int64_t dense = 0;   // embedding, attention, norms, routers, shared experts, dense FFNs, LM head
  int64_t expert = 0;  // routed experts, all layers
};
ParameterSplit split_parameters(const ModelConfig& mc);

// Bytes per parameter the optimizer step reads and writes: fp32 master (hi + lo) read and
// written, the fp32 gradient read, both AdamW moments read and written, the bf16 weight written.
double optimizer_bytes_per_parameter(double moment_bytes);

// Per-category milliseconds of one unit of work, for one target GPU.
struct ComputeRates {
  double attention_ms_per_flop = 0, expert_ms_per_flop = 0, dense_ms_per_flop = 0, lm_head_ms_per_flop = 0;
  double memory_ms_per_element = 0;
  double optimizer_ms_per_byte = 0;
};
// From the hardware's peaks and efficiencies (no measurement).
ComputeRates rates_from_hardware(const HardwareDescription& hw);
// From a measured profile, moved to `hw` (GEMM categories by the ratio of peaks, memory and
// optimizer by the ratio of HBM bandwidths); a category the profile's model lacks (dense
// FFN in an all-MoE bench model) takes the experts' rate.
ComputeRates rates_from_profile(const ComputeProfile& profile, const HardwareDescription& hw);
// Bytes per memory element the no-profile rates assume (fitted to the H200 profile).
constexpr double kMemoryBytesPerElement = 64.0;

// Measured collective bandwidths that replace the hardware's alpha-beta where given.
struct MeasuredCollectives {
  double intra_all_to_all_bytes_per_s = 0;  // a2a-bench inside one node (0: none)
  // allreduce-bench inside one node (0: none): the largest size's bus bandwidth and the
  // smallest size's time as the latency of one call.
  double intra_all_reduce_bus_bytes_per_s = 0, intra_all_reduce_latency_us = 0;
};

// Fraction of a rank's experts-hit: under uniform routing of K distinct experts among
// `pool` experts, the probability that a given set of `held` experts gets at least one:
// 1 - C(pool - held, K) / C(pool, K).
double probability_hit(int64_t pool, int64_t held, int64_t k);

// Rows a token sends per exchange (one per destination rank holding any of its experts;
// moe-train sends a token once per rank, not once per assignment), to other ranks of the
// EP group, split by whether they are on the token's node. Node-first routing with
// `route_groups` groups (route_top_groups picked per token; groups = blocks of EP ranks).
// node_distinct: distinct other nodes a token reaches (what a per-node deduplicating
// exchange would send; moe-train's does not deduplicate per node).
struct ExchangeRows {
  double same_node = 0;   // rows to other ranks of the same node
  double other_nodes = 0; // rows to ranks of other nodes
  double node_distinct = 0;
};
ExchangeRows exchange_rows(int64_t n_experts, int64_t top_k, int64_t ep, int64_t ep_ranks_per_node,
                           int64_t route_groups, int64_t route_top_groups);

// Alpha-beta: messages x latency + bytes / rate, in ms.
double alpha_beta_ms(double bytes, double messages, double latency_us, double bytes_per_s);

struct ExchangeTime {
  double ms = 0;
  double intra_bytes = 0, inter_bytes = 0;        // per rank per exchange
  int64_t intra_messages = 0, inter_messages = 0;  // per rank per exchange
};
// One exchange (dispatch or combine) of `bytes_per_row` rows. flat: one all-to-all, the
// NVLink and NIC parts at once (the slower decides). hierarchical: inside the node first
// (each row to the rank with its destination's local index), then across nodes among equal
// local indices (one message per node); the stages one after the other.
ExchangeTime exchange_time(AllToAllKind kind, const ExchangeRows& rows, double tokens, double bytes_per_row,
                           int64_t ep, int64_t ep_ranks_per_node, const HardwareDescription& hw,
                           const MeasuredCollectives& measured);

// Ring collectives over n ranks, m of them per node (n / m nodes), NCCL's ring bandwidth
// and tree latency: all-reduce 2 (n-1)/n x bytes, reduce-scatter and all-gather (n-1)/n x
// bytes (bytes: the whole buffer), at the NVLink rate inside one node and at the GPU's NIC
// share across nodes; latency per call 2 x (log2(nodes) inter + (m-1) intra), times `calls`.
enum class Collective { AllReduce, ReduceScatter, AllGather };
// Inside one node a measured all-reduce sweep (`measured`) replaces both: its bus bandwidth
// as the rate of all three, its latency per all-reduce call (half per reduce-scatter or
// all-gather).
double collective_ms(Collective kind, double bytes, int64_t n, int64_t m, double calls, const HardwareDescription& hw,
                     int64_t gpus_per_node, const MeasuredCollectives& measured = {});

// Communication overlapped with a window of compute: what shows is what outlasts the window,
// and at least the last piece (it starts only when the window's last stage is done).
double exposed_ms(double comm_ms, double window_ms, double last_piece_ms);
// The part of comm_ms that runs beside compute: comm_ms less what shows.
inline double overlapped_ms(double comm_ms, double exposed) { return comm_ms > exposed ? comm_ms - exposed : 0.0; }

// The busiest EP rank's rows over the mean, less 1 (SimLayout::expert_imbalance), from the
// per-expert imbalance that training logs (max over experts of assignments over the mean,
// less 1: the step lines' `imbalance`), for n_experts top_k experts over expert_parallel
// ranks holding n_experts / expert_parallel each: the busiest expert's rank also gets an
// even share of the rest (the other experts' assignments spread evenly). 0 for one rank;
// refused with one line past top_k's bound (an expert gets each token once at most:
// n_experts / top_k - 1).
double rank_imbalance_of_expert_imbalance(double expert_imbalance, int64_t n_experts, int64_t top_k,
                                          int64_t expert_parallel);

// The same from logged counts: each row of tokens_RE (one MoE layer of one step, n_experts
// counts) over expert_parallel ranks holding consecutive experts (the placement before any
// re-placement), the busiest rank's rows over the mean; the mean over the rows, less 1 (the
// step waits for each layer's busiest rank, and every layer routes the same rows). Rows
// without assignments are skipped.
double rank_imbalance_of_expert_loads(const std::vector<std::vector<int64_t>>& tokens_RE, int64_t expert_parallel);

// The layout simulated.
struct SimLayout {
  int64_t gpus = 1, gpus_per_node = 8;
  int64_t expert_parallel = 1;
  int64_t zero = 0;
  int64_t micro_batches = 1;  // per rank per optimizer step (accumulation)
  AllToAllKind all_to_all = AllToAllKind::Flat;
  double expert_imbalance = 0;  // the busiest rank's expert rows over the mean, less 1
};

struct StepPrediction {
  SimLayout layout;
  // ms per step on the busiest rank
  double attention = 0, experts = 0, dense = 0, lm_head = 0, memory = 0;  // forward + backward, all micro-batches
  double compute = 0;             // their sum
  double optimizer = 0;
  double a2a = 0;                 // the exchanges (not overlapped in moe-train)
  double grad_sync = 0, grad_sync_exposed = 0;  // reduce(-scatter) of the gradients, overlapped with the last backward
  double overlap_cost = 0;        // compute lost to the collectives beside it (overlap_slowdown x overlapped ms)
  double weight_gather = 0, weight_gather_exposed = 0;  // ZeRO 1-2: after the optimizer; 3: per layer, prefetched
  double step = 0;
  double comm_share = 0;          // exposed communication / step
  double efficiency = 0;          // weak scaling: (compute with even expert rows + optimizer) / step
  double tokens_per_s_per_gpu = 0;
  ExchangeRows rows;
  ExchangeTime exchange;          // one exchange
  double exchanges = 0;           // per step: 4 per MoE layer and micro-batch, 2 more per recomputed MoE layer
  double a2a_row_bytes = 0;       // per step, the token rows this rank sends to other ranks (both directions' exchanges)
  double grad_bytes = 0;          // gradient bytes this rank reduces per step
  int64_t ep_nodes = 1, ep_ranks_per_node = 1;
};

// `config`: the model (model.*, moe.*), micro-batch, optimizer.state_dtype and
// parallel.grad_reduce_dtype / bucket_mb. Throws a one-line ConfigError for a layout that
// cannot be (EP not dividing the GPUs or the experts, an EP group straddling nodes unevenly).
StepPrediction simulate_step(const RunConfig& config, const SimLayout& layout, const HardwareDescription& hw,
                             const ComputeRates& rates, const MeasuredCollectives& measured = {});

}  // namespace moe
