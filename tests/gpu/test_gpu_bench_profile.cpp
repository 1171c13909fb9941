// `moe bench --json`'s compute profile (train/cuda/gpu_bench.h -> train/hardware_description.h)
// on a real GPU step: every phase timed, the profile read back as written, and the
// simulator given it reproducing the bench's own step (the phase means sum) at one GPU;
// and `moe bench --sm-clocks`'s clock for each phase.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <sstream>

#include "core/error.h"
#include "small_models.h"
#include "train/cuda/gpu_bench.h"
#include "train/hardware_description.h"
#include "train/step_simulator.h"

namespace moe {
namespace {

// A small MoE model with the phase split (no CUDA graphs).
RunConfig small_bench() {
  RunConfig config;
  config.model = test::small_moe_model(0.0);
  config.training.micro_batch = 2;
  config.training.cuda_graphs = false;
  return config;
}

TEST(GpuBenchProfile, TheSimulatorGivesBackTheMeasuredStep) {
  RunConfig config = small_bench();
  std::ostringstream log;
  const GpuBenchResult bench = run_gpu_bench(config, GpuBenchOptions{1, 3}, log);
  ASSERT_FALSE(bench.phase_ms.empty()) << log.str();
  double sum = 0;
  for (const auto& [name, ms] : bench.phase_ms) sum += ms;
  EXPECT_GT(bench.phase_ms.at("experts"), 0);
  EXPECT_GT(bench.phase_ms.at("attention"), 0);
  EXPECT_GT(bench.phase_ms.at("dense FFN"), 0);
  EXPECT_GT(bench.phase_ms.at("optimizer"), 0);

  ComputeProfile profile;
  profile.source = "test";
  profile.peak_tflops = 989;
  profile.hbm_tb_s = 4.8;
  profile.config = config;
  profile.phase_ms = bench.phase_ms;
  const ComputeProfile back = parse_compute_profile(compute_profile_json(profile), "profile.json");
  EXPECT_EQ(back.phase_ms, profile.phase_ms);

  HardwareDescription hw;
  hw.name = "test";
  hw.gpus_per_node = 8;
  hw.peak_tflops = 989;
  hw.hbm_tb_s = 4.8;
  hw.matmul_efficiency = hw.memory_efficiency = hw.intra_efficiency = hw.inter_efficiency = 0.5;
  hw.intra_bandwidth_gb_s = 450;
  hw.nics_per_node = 8;
  hw.nic_gbit_s = 400;
  SimLayout one;
  one.gpus = one.gpus_per_node = 1;
  RunConfig simulated = config;
  simulated.parallel.zero = 0;
  const StepPrediction p = simulate_step(simulated, one, hw, rates_from_profile(back, hw));
  // Every phase the simulator prices comes from the profile (the all-to-all phase is 0 on one GPU).
  EXPECT_NEAR(p.step, sum - (bench.phase_ms.count("all-to-all") ? bench.phase_ms.at("all-to-all") : 0), 1e-6 * sum);
  // The phases are CUDA events around the step's kernels: their sum is the step within the gaps.
  EXPECT_NEAR(p.step, bench.median_step_ms, 0.25 * bench.median_step_ms) << log.str();
}

// `moe bench --sm-clocks`: every phase that took time has its SMs' clock, within what the
// device can run at, and without the flag none is reported.
TEST(GpuBenchProfile, SmClocksForEveryTimedPhase) {
  RunConfig config = small_bench();
  std::ostringstream log;
  GpuBenchOptions options{1, 2};
  EXPECT_TRUE(run_gpu_bench(config, options, log).phase_sm_mhz.empty());
  options.sm_clocks = true;
  const GpuBenchResult bench = run_gpu_bench(config, options, log);
  int device = 0, max_khz = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&max_khz, cudaDevAttrClockRate, device), cudaSuccess);
  for (const char* phase : {"attention", "experts", "optimizer", "norms+residual"}) {
    ASSERT_TRUE(bench.phase_sm_mhz.count(phase)) << phase << "\n" << log.str();
    EXPECT_GT(bench.phase_sm_mhz.at(phase), 100.0) << phase;
    EXPECT_LT(bench.phase_sm_mhz.at(phase), 1.02e-3 * max_khz) << phase;
  }
  EXPECT_NE(log.str().find("SM clock over the phases"), std::string::npos) << log.str();
  config.training.cuda_graphs = true;
  EXPECT_THROW(run_gpu_bench(config, options, log), ConfigError);
}

}  // namespace
}  // namespace moe
