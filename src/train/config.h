// A run's full configuration: TOML sections [model] [moe] [training] [optimizer] [lr]
// [data] [metrics] [checkpoint]. Every key, its type, default and allowed values are
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
};

struct OptimizerConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;          // decoupled; never applied to norms and biases
};

struct LrConfig {
  double peak = 3e-3;
  int64_t warmup_steps = 30;          // linear from peak/warmup to peak
  double min_ratio = 0.1;             // cosine decays to peak*min_ratio at the last step
};

struct DataConfig {
  std::string dir = "/usr/share/doc/python3.11-doc/html/_sources";
  std::string extension = ".txt";     // files under dir whose name ends with this
  std::string tokenizer = "byte";     // byte (BPE comes later)
  double val_fraction = 0.05;         // share of documents held out, chosen by path hash
  int64_t max_bytes = 0;              // read at most this many bytes of text (0: all)
};

struct MetricsConfig {
  int64_t log_interval = 10;          // console line every N steps
  std::string dir = "";               // per-run output folder ("" : none)
};

struct CheckpointConfig {
  std::string dir = "";               // "" : no checkpoints
  int64_t interval = 0;               // steps between checkpoints; 0: only at the end
  int64_t keep_last = 3;              // newest checkpoints kept on disk (>= 1)
};

struct RunConfig {
  ModelConfig model;
  TrainingConfig training;
  OptimizerConfig optimizer;
  LrConfig lr;
  DataConfig data;
  MetricsConfig metrics;
  CheckpointConfig checkpoint;
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
