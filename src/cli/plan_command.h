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
};

int run_plan(const PlanOptions& options, std::ostream& out);

}  // namespace moe
