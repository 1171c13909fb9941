// Standalone driver for the GPU benchmark until `moe bench` is wired into the CLI:
//   moe_gpu_bench CONFIG.toml [warmup] [timed]
#include <iostream>

#include "core/error.h"
#include "config/run_config.h"
#include "train/cuda/gpu_bench.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: moe_gpu_bench CONFIG.toml [warmup_steps] [timed_steps]\n";
    return 2;
  }
  try {
    const moe::RunConfig config = moe::load_config(argv[1]);
    const int warmup = argc > 2 ? std::atoi(argv[2]) : 3;
    const int timed = argc > 3 ? std::atoi(argv[3]) : 10;
    moe::run_gpu_bench(config, moe::GpuBenchOptions{warmup, timed}, std::cout);
  } catch (const moe::ConfigError& e) {
    std::cerr << "moe_gpu_bench: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moe_gpu_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
