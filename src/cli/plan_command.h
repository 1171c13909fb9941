// `moe plan`: the per-GPU memory of a training layout and the layouts that fit
// (train/memory_plan.h), callable from tests without a process.
#pragma once
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace moe {

struct PlanOptions {
  std::string config_path;
  std::optional<int64_t> gpus;           // default: parallel.expert_parallel (the fewest the config launches on)
  std::optional<int64_t> gpus_per_node;  // default: min(8, gpus)
  std::optional<double> gpu_memory_gb;   // default: kDefaultGpuMemoryGb; the reserve is taken off either
  std::vector<std::string> overrides;    // "section.key=value"
  int max_layouts = 10;                  // rows of the fitting layouts printed
  // --simulate: the step-time model (train/step_simulator.h, docs/SIMULATOR.md) instead of memory.
  bool simulate = false;
  std::string hardware;                  // configs/hardware/*.toml (required with --simulate)
  std::string compute;                   // `moe bench --json` profile; empty: the hardware's peaks x efficiencies
  std::vector<std::string> collectives;  // `moe a2a-bench --json`, `moe allreduce-bench --json` inside one node; none: alpha-beta only
  std::optional<int64_t> micro_batches;  // per GPU per step; default: global_batch_tokens / (GPUs x micro-batch tokens)
  double expert_imbalance = 0;           // busiest EP rank's expert rows over the mean, less 1
  std::optional<double> expert_load_imbalance;  // or from the logged per-expert imbalance (max / mean - 1)
  std::string expert_loads;              // or from a run's metrics.jsonl (layers[].tokens_per_expert)
  bool json = false;                     // one JSON object instead of the table
};

int run_plan(const PlanOptions& options, std::ostream& out);
// `moe plan --simulate` (src/cli/simulate_command.cpp).
int run_simulate(const PlanOptions& options, std::ostream& out);

}  // namespace moe
