// `moe bench` on one GPU: timed optimizer steps (forward, backward, AdamW) of the
// configured model on random tokens, reported as tokens/s, MFU with the inputs of its
// formula, step time, device memory, and the SM clock and power the timed steps ran at.
#pragma once
#include <iosfwd>
#include <map>
#include <string>

#include "config/run_config.h"
#include "obs/board_power.h"

namespace moe {

struct GpuBenchResult {
  double median_step_ms = 0;
  double tokens_per_second = 0;
  double mfu = 0;
  double device_gb = 0;
  std::map<std::string, double> phase_ms;  // mean per timed step (empty with CUDA graphs)
  std::map<std::string, double> phase_sm_mhz;  // each phase's mean SM clock (with sm_clocks only)
  BoardSummary board;  // the SM clock and power over the timed steps (no samples without NVML; the
                       // SMs' own count with sm_clocks)
};

struct GpuBenchOptions {
  int warmup_steps = 3;
  int timed_steps = 10;
  // Through the expert-parallel path over this one GPU (LoopbackExpertExchange: every
  // exchange a device copy), to time that path's own kernels apart from any network.
  bool ep_loopback = false;
  // Each phase's mean SM clock from the SMs' cycle counters (core/cuda/sm_clocks.h): a
  // stamp kernel at every phase boundary, a few microseconds each.
  bool sm_clocks = false;
};
GpuBenchResult run_gpu_bench(const RunConfig& config, const GpuBenchOptions& options, std::ostream& out);

// `moe bench --kernels`: the expert GEMMs of one MoE layer at the config's shapes, each
// timed alone (grouped GEMM and the per-expert cuBLASLt loop), against the dense GEMM of
// the same size (src/train/cuda/kernel_bench.cpp); then the FP8 grouped and dense GEMMs
// beside the bf16 ones and the quantisation kernels (kernel_bench_fp8.cpp). sustain_ms > 0:
// instead, CUTLASS's and DeepGEMM's expert GEMMs and the dense GEMM each run back to back for
// that long (bench::SustainedTimer): their rates under the board's power limit, with the
// clock and power; the fp8 section's kernels timed the same way. The sections run can be
// chosen (`--kernel-sections`): the six expert GEMMs, our fused SwiGLU kernels against the
// GEMM + pass they replace, the gate|up weight gradient's output variants, the fp8 section.
struct KernelBenchOptions {
  double sustain_ms = 0;
  bool gemms = true, swiglu = true, wgrad = true, fp8 = true;
};
void run_kernel_bench(const RunConfig& config, std::ostream& out, const KernelBenchOptions& options = {});

}  // namespace moe
