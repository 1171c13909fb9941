// The simulator's input files (train/step_simulator.h): hardware descriptions (TOML,
// configs/hardware/), compute profiles (`moe bench --json`) and measured collectives
// (`moe a2a-bench --json`, `moe allreduce-bench --json`). Every bad value is refused with one line naming the
// file and the key (docs/SIMULATOR.md lists the keys).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "dist/all_reduce_bench.h"
#include "dist/all_to_all_bench.h"

#include "train/step_simulator.h"

namespace moe {

HardwareDescription parse_hardware_description(const std::string& text, const std::string& source);
HardwareDescription load_hardware_description(const std::string& path);

// The profile `moe bench --json` writes: the bench config's model shape, micro-batch and
// moment dtype, the GPU's peaks, and the mean ms per step of each phase.
std::string compute_profile_json(const ComputeProfile& profile);
ComputeProfile parse_compute_profile(const std::string& text, const std::string& source);
ComputeProfile load_compute_profile(const std::string& path);

// `moe a2a-bench --json`: {"format": "moe-a2a-bench-1", "ranks", "nodes", "backend",
// "off_rank_bytes", "results": [{"kind", "dispatch_ms", "combine_ms", "dispatch_gb_s",
// "combine_gb_s"}]}. Read back as the flat exchange's GB/s inside one node (a run over
// more than one node gives none).
std::string all_to_all_bench_json(const std::vector<dist::AllToAllBenchResult>& results, const std::string& backend);
// `moe allreduce-bench --json`: {"format": "moe-allreduce-bench-1", "ranks", "nodes",
// "backend", "results": [{"bytes", "ms", "algbw_gb_s", "busbw_gb_s", "sums_ok"}]}. Read
// back (one node only, every sum checked) as the all-reduce's alpha-beta: the latency the
// smallest size's time, the bus bandwidth the largest size's.
std::string all_reduce_bench_json(const dist::AllReduceSweep& sweep, const std::string& backend);
// Either format (its "format" key decides); several files merged, a later one's values
// replacing an earlier one's.
MeasuredCollectives parse_measured_collectives(const std::string& text, const std::string& source);
MeasuredCollectives load_measured_collectives(const std::vector<std::string>& paths);

// The routed loads a run logged (its metrics.jsonl, docs/METRICS.md): every `step` record's
// layers[].tokens_per_expert, one row of n_experts counts per (step, MoE layer). Refused
// with one line: no step record with layers, rows of different lengths, a negative count.
struct ExpertLoads {
  int64_t n_experts = 0;
  std::vector<std::vector<int64_t>> tokens_RE;  // rows (step, layer) x experts
};
ExpertLoads parse_expert_loads(const std::string& jsonl, const std::string& source);
ExpertLoads load_expert_loads(const std::string& path);

}  // namespace moe
