// The subcommands of the `moe` binary, callable from tests without a process.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "train/export.h"

namespace moe {

struct TrainOptions {
  std::string config_path;
  std::optional<std::string> device;
  std::optional<int64_t> threads;
  std::vector<std::string> overrides;  // "section.key=value"
  std::optional<int> dashboard_port;   // serve the live dashboard here (0: any free port)
  std::optional<std::string> resume;   // "auto" (newest in checkpoint.dir, if any) or a checkpoint directory
  bool discard_newer_checkpoints = false;  // with --resume: delete checkpoint.dir's later checkpoints
  std::optional<std::string> init_from_hf;  // a Hugging Face Mixtral folder to start from (train/hf_import.h)
  std::optional<int> thread_ranks;     // this many ranks as threads on this one GPU (a rehearsal)
  std::optional<int> thread_ranks_per_node;  // ... in simulated nodes of this many ranks
};

struct ReportOptions {
  std::string run_dir;  // holds metrics.jsonl (metrics.dir of the run)
  std::string output;   // empty: run_dir/report.html
};

struct ConfigOptions {
  std::string config_path;  // empty: built-in defaults
  std::vector<std::string> overrides;
};

struct BenchOptions {
  std::string config_path;
  int warmup_steps = 3;
  int timed_steps = 10;
  bool kernels = false;  // also time the expert GEMMs one by one
  int sustain_ms = 0;  // > 0: each of them back to back for this long instead (its rate under the power limit)
  bool no_steps = false;  // --kernels only: no training steps timed first
  std::vector<std::string> kernel_sections;  // the parts of --kernels to run (empty: all)
  bool ep_loopback = false;  // through the expert-parallel path over this one GPU
  bool sm_clocks = false;    // each phase's mean SM clock (a stamp kernel at each phase boundary)
  std::string json;          // also write the phase times as a compute profile (docs/SIMULATOR.md)
  std::vector<std::string> overrides;
};

struct AllToAllBenchOptions {
  std::string config_path;
  int warmup = 3;
  int iters = 20;
  std::string json;  // rank 0 also writes the results as JSON (moe plan --simulate --collectives)
  std::vector<std::string> overrides;
};

// `moe eval`: a checkpoint's loss and perplexity on the held-out split of its run's data
// (or of data.dir / data.shards given as overrides), in this one process.
struct EvalOptions {
  std::string checkpoint;              // checkpoint.dir/step_N
  std::optional<std::string> device;   // overrides training.device
  std::optional<int64_t> batches;      // micro-batches of training.micro_batch; default: the whole split
  std::vector<std::string> overrides;  // "section.key=value", over the checkpoint's config
};

int run_train(const TrainOptions& options);
int run_eval(const EvalOptions& options);
// `moe a2a-bench`: the MoE exchanges alone over the launch's ranks (dist/all_to_all_bench.h).
int run_all_to_all_bench(const AllToAllBenchOptions& options);

// `moe allreduce-bench`: the all-reduce sweep over the launch's ranks (dist/all_reduce_bench.h).
struct AllReduceBenchOptions {
  std::string config_path;  // only parallel.* (the backend) is read
  int64_t min_bytes = 4096;
  int64_t max_bytes = int64_t{1} << 30;
  int warmup = 3;
  int iters = 10;
  std::string json;  // rank 0 also writes the sweep as JSON (moe plan --simulate --collectives)
  std::vector<std::string> overrides;
};
int run_all_reduce_bench(const AllReduceBenchOptions& options);
// `moe bench`: the GPU benchmark (train/cuda/gpu_bench.h); a config error without CUDA.
int run_bench(const BenchOptions& options);
int run_config(const ConfigOptions& options);
int run_report(const ReportOptions& options);
int run_export(const ExportOptions& options);

}  // namespace moe
