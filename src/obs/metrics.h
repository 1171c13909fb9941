// Per-step training metrics and the run facts they are computed from: one struct the
// trainer fills, which every sink (console, JSONL, TensorBoard, dashboard) reads.
// Field names here are the JSONL field names (docs/METRICS.md lists them all).
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "obs/board_power.h"

namespace moe {

// max/mean - 1 of a load vector (0 when it is all zero).
double load_imbalance(const std::vector<int64_t>& load_E);
// Standard deviation / mean (population), 0 when the load is all zero.
double load_cv(const std::vector<int64_t>& load_E);

// One expert merge (moe.merge_interval, docs/EXPERT_MERGING.md): `freed` merged into
// `kept` (kept's share of the average: kept_share), then re-initialised as a split of
// `split_of`; similarity: the cosine of the two experts' weights.
struct MergeRecord {
  int64_t kept = 0, freed = 0, split_of = 0;
  double similarity = 0, kept_share = 0;
};

// One MoE layer's routing during one optimizer step (all micro-batches).
struct LayerRouting {
  int64_t layer = 0;               // block index in the model
  std::vector<int64_t> tokens_E;   // assignments each expert processed, after dropping
  int64_t assignments = 0;         // assignments routed, before dropping (tokens * top_k)
  int64_t dropped = 0;             // assignments dropped by capacity
  double router_entropy = 0;       // mean over tokens of the routing distribution's entropy, nats
  std::vector<double> bias_E;      // aux-loss-free balancing bias; empty when that is off
  // moe.route_cache: assignments / tokens whose experts the cache predicted from the layer
  // before; -1: not measured (off, or the first MoE layer).
  double route_cache_hit_rate = -1, route_cache_token_hit_rate = -1;
  int a2a_fp8 = -1;                // expert exchange's rows this step: 1 fp8, 0 uncompressed, -1 no exchange
  // moe.speculative_dispatch (MoE layers after the first; -1: off): token rows sent to
  // other EP ranks before the router, used / not used, and sent after it (corrections),
  // summed over the ranks. spec_used_share() = used / (used + corrected).
  int64_t spec_rows_used = -1, spec_rows_wasted = -1, spec_rows_corrected = -1;
  // Expert parallelism: ms the forwards' dispatches of the step blocked on the exchange
  // (its plan's exchanges and the token rows, not the results), mean over the ranks; -1: none.
  double a2a_dispatch_wait_ms = -1;
  double spec_used_share() const {
    const int64_t sent = spec_rows_used + spec_rows_corrected;
    return sent > 0 ? static_cast<double>(spec_rows_used) / static_cast<double>(sent) : 0;
  }
  double temperature = 0;          // the router temperature the step routed with (per layer)
  std::vector<MergeRecord> merges; // expert merges after this step (empty: none)
  double imbalance() const { return load_imbalance(tokens_E); }
  double cv() const { return load_cv(tokens_E); }
  double dropped_fraction() const;
};

// Which experts one rank holds and how many assignments they processed (all layers).
struct RankLoad {
  int64_t rank = 0;
  std::vector<int64_t> experts;  // expert ids held
  std::vector<int64_t> load;     // per held expert, summed over the MoE layers
};

// Wall time of one step and its parts. comm_wait is time blocked on communication that
// compute did not hide; 0 in a single-process run.
struct StepTimes {
  double step = 0, compute = 0, comm_wait = 0, data_wait = 0, optimizer = 0;
};

// One timed part of a step, for metrics.trace (obs/trace.h): `start` in seconds since the
// run's start, on a track ("host": the training thread; "gpu": the model's stream).
struct PhaseSpan {
  std::string name;
  std::string track;
  double start = 0, seconds = 0;
};

struct StepMetrics {
  int64_t step = 0;       // 1-based optimizer step
  int64_t steps = 0;      // steps in the run
  double wall_time = 0;   // unix seconds when the step ended
  double loss = 0, aux_loss = 0, z_loss = 0;
  double lr = 0;
  double grad_norm = 0, max_expert_grad_norm = 0;  // before clipping
  bool skipped = false;   // non-finite gradient: the update was not applied
  int64_t tokens = 0;     // tokens in this step
  double tokens_per_s = 0;
  double mfu = 0;         // fraction of peak, see MfuInputs
  StepTimes time;
  double grad_sync_ms = 0;  // data-parallel gradient synchronisation; 0 in one process
  int64_t a2a_bytes = 0;    // expert-parallel all-to-all: bytes this rank sent to other ranks
  int64_t a2a_off_node_bytes = 0;  // of those, what went to ranks of other (simulated) nodes (GPU: token rows only)
  double a2a_bandwidth = 0; // those bytes / the exchanges' time (issue to completion), bytes/s
  int64_t arena_bytes = 0;  // parameters, gradients, optimizer state and activation arenas
  int64_t rss_bytes = 0;    // resident set of the process
  std::vector<LayerRouting> layers;
  std::vector<RankLoad> ranks;
  std::vector<std::pair<std::string, double>> phase_ms;  // metrics.phase_times: the step's time per phase
  std::vector<PhaseSpan> spans;  // metrics.trace: the step's phases (not a JSONL field)
  BoardSummary board;  // GPU: the SM clock and power sampled during the step (no samples: none)

  double max_imbalance() const;
  double comm_wait_fraction() const { return time.step > 0 ? time.comm_wait / time.step : 0; }
};

// DESIGN.md's count (TorchTitan's): flops per token = 6 x active non-embedding
// parameters + 12 x layers x dim x seq_len (attention); MFU = tokens/s x that / peak.
struct MfuInputs {
  int64_t active_non_embedding_params = 0;
  int64_t n_layers = 0, dim = 0, seq_len = 0;
  double peak_flops = 989e12;  // 0: none for this device (the CPU): MFU not reported
  double flops_per_token() const;
  double mfu(double tokens_per_s) const;
  std::string describe() const;  // the formula with its inputs, for the log
};

// Facts about the run that do not change per step.
struct RunInfo {
  std::string run_id;      // the run's identity (metrics.dir/run.json, checkpoint manifests)
  int64_t steps = 0;
  int64_t first_step = 0;  // steps already done before this process (a resumed run)
  int64_t tokens_per_step = 0;
  int64_t n_layers = 0;
  std::vector<int64_t> moe_layers;  // block indices of the MoE layers
  int64_t n_experts = 0, top_k = 0;
  int64_t world_size = 1;
  int64_t params_total = 0, params_active = 0;
  bool bias_balancing = false;
  bool temperature_control = false;
  MfuInputs mfu;
  // When validations and checkpoint saves come (the console's ETA counts them): every
  // val_interval steps and after the last one; checkpoints likewise when `checkpoints`.
  int64_t val_interval = 0, checkpoint_interval = 0;
  bool checkpoints = false;
};

// Resident set size of this process in bytes (0 where /proc is unavailable).
int64_t resident_set_bytes();

// One JSONL record each: {"type": "run" | "step", ...}.
nlohmann::json to_json(const RunInfo& info);
nlohmann::json to_json(const StepMetrics& m);

}  // namespace moe
