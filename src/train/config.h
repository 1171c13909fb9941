// A run's full configuration: TOML sections [model] [moe] [training] [optimizer] [lr]
// [data] [metrics] [checkpoint] [parallel]. Every key, its type, default and allowed values are
// in docs/CONFIG.md. Loading rejects unknown keys and bad values with a ConfigError
// naming the key.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace moe {

struct TrainingConfig {
  int64_t steps = 300;                // optimizer steps
  int64_t global_batch_tokens = 8192; // tokens per optimizer step (reached by accumulation)
  int64_t micro_batch = 8;            // sequences per micro-batch
  uint64_t seed = 1234;               // weights, data order
  int64_t threads = 0;                // 0: all cores
  std::string device = "auto";        // auto | cpu | cuda (auto: a GPU when the CUDA backend has one)
  double grad_clip = 1.0;             // global gradient-norm clip; 0 disables
  double expert_grad_clip = 0.0;      // per-expert gradient-norm clip; 0 disables
  int64_t val_interval = 50;          // validation every N steps (and at the start and end); 0: start and end only
  int64_t val_batches = 8;            // micro-batches of held-out data per validation
  int64_t stop_at = 0;                // stop (and checkpoint) after this step as if preempted; 0: run to steps
  int64_t nan_max_skips = 3;          // non-finite steps in a row before reloading the last checkpoint; 0: never
  double nan_lr_factor = 0.5;         // each such reload multiplies the learning rate by this
  double loss_spike_factor = 3.0;     // warn when a loss exceeds this times the running mean; 0: off
  int64_t memory_limit_mb = 0;        // activation memory per micro-batch; over it the micro-batch is halved; 0: none
  int64_t recompute_layers = 0;       // GPU: recompute the activations of the first N layers in the backward; -1: all
  std::string recompute_experts = "none";  // GPU: none | swiglu | all: what MoE layers recompute in the backward
  bool cuda_graphs = false;           // GPU: capture forward + backward of a micro-batch once, replay it
  bool deterministic = true;          // GPU: every reduction in a fixed order (bit-identical reruns)
};

struct OptimizerConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;          // decoupled; never applied to norms and biases
  std::string state_dtype = "fp32";   // fp32 | bf16: storage of the AdamW moments m and v
};

struct LrConfig {
  double peak = 3e-3;
  int64_t warmup_steps = 30;          // linear from peak/warmup to peak
  double min_ratio = 0.1;             // cosine decays to peak*min_ratio at the last step
};

struct DataConfig {
  std::string dir = "/usr/share/doc/python3.11-doc/html/_sources";
  std::string extension = ".txt";     // files under dir whose name ends with this
  std::string tokenizer = "byte";     // byte | bpe:<vocab> | path/tokenizer.json | tiktoken:<pattern>:<file>
  double val_fraction = 0.05;         // share of documents held out, chosen by path hash
  int64_t max_bytes = 0;              // read at most this many bytes of text (0: all)
  std::string shards = "";            // a `moe tokenize` output folder to train from instead of dir ("" : read dir)
};

struct MetricsConfig {
  int64_t log_interval = 10;          // console line every N steps
  std::string dir = "";               // per-run output folder ("" : none)
  bool tensorboard = true;            // also write TensorBoard event files into dir
  double peak_tflops = 989.0;         // peak dense TFLOP/s per device, for MFU (H100/H200 bf16)
  double alert_imbalance = 0.15;      // alert when expert load max/mean - 1 exceeds this
  double alert_comm_wait = 0.20;      // alert when communication wait exceeds this share of a step
  double alert_grad_sync_ms = 5.0;    // alert when gradient-sync latency exceeds this
  bool phase_times = false;           // GPU: log each step's time per phase (CUDA events on the model's stream)
};

struct CheckpointConfig {
  std::string dir = "";               // "" : no checkpoints
  int64_t interval = 0;               // steps between checkpoints; 0: only at the end
  int64_t keep_last = 3;              // newest checkpoints kept on disk (>= 1)
  bool async = false;                 // write on a background thread; training stalls only for the copy
};

// Data and expert parallelism across ranks; the world size comes from the launcher
// (mpirun, Slurm, torchrun-style variables; src/dist/launch_env.h).
struct ParallelConfig {
  int64_t expert_parallel = 1;        // EP size: ranks that share one copy of the experts; divides world and moe.n_experts
  std::string all_to_all = "flat";    // flat | hierarchical (intra-node, then inter-node)
  double bucket_mb = 25.0;            // dense-gradient reduce-scatter bucket; 0: one bucket per layer
  int64_t a2a_chunks = 1;             // token chunks whose all-to-all overlaps the experts' compute
  std::string grad_reduce_dtype = "fp32";  // GPU data parallel: fp32 | bf16 (half the traffic, sums rounded)
  int64_t comm_sms = 0;               // GPU: multiprocessors the GEMMs leave to NCCL while gradient sums overlap backward
  bool shard_optimizer = true;        // GPU data parallel: ZeRO-1 (gradients reduce-scattered, 1/N of the AdamW step per rank)
  int64_t rebalance_interval = 0;     // steps between re-placements of the experts by measured load; 0: never
  int64_t rebalance_max_experts = 0;  // most experts one EP rank may hold after a re-placement; 0: n_experts / EP (equal)
  bool split_experts = false;         // GPU EP: each rank's first expert shared with the rank before, rows evened per micro-batch
  std::string backend = "auto";       // auto | mpi | single | tcp | nccl (auto: from the launcher, see src/dist/communicator.cpp)
};

struct RunConfig {
  ModelConfig model;
  TrainingConfig training;
  OptimizerConfig optimizer;
  LrConfig lr;
  DataConfig data;
  MetricsConfig metrics;
  CheckpointConfig checkpoint;
  ParallelConfig parallel;
};

// Parse TOML text (`source_name` names it in errors), then apply `overrides` of the
// form "section.key=value" (value in TOML syntax, or a bare string). Validates the result.
RunConfig parse_config(const std::string& toml_text, const std::string& source_name,
                       const std::vector<std::string>& overrides = {});
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Throws ConfigError naming the first key whose value is not allowed.
void validate_config(const RunConfig& config);
// The config as TOML, every key written (round-trips through parse_config).
std::string config_to_toml(const RunConfig& config);

}  // namespace moe
