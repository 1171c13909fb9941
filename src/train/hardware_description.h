// The simulator's input files (train/step_simulator.h): hardware descriptions (TOML,
// configs/hardware/), compute profiles (`moe bench --json`) and measured all-to-all
// bandwidths (`moe a2a-bench --json`). Every bad value is refused with one line naming the
// file and the key (docs/SIMULATOR.md lists the keys).
#pragma once
#include <map>
#include <string>
#include <vector>

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

// `moe a2a-bench --json`: {"ranks", "nodes", "backend", "off_rank_bytes", "results":
// [{"kind", "dispatch_ms", "combine_ms", "dispatch_gb_s", "combine_gb_s"}]}. Read back as
// the flat exchange's GB/s inside one node (a run over more than one node gives none).
std::string all_to_all_bench_json(const std::vector<dist::AllToAllBenchResult>& results, const std::string& backend);
MeasuredCollectives parse_measured_collectives(const std::string& text, const std::string& source);
MeasuredCollectives load_measured_collectives(const std::string& path);

}  // namespace moe
