// A run's full configuration: TOML sections [model] [moe] [training] [optimizer] [lr]
// [data] [metrics] [checkpoint] [parallel], one header per section beside this one, so a
// layer includes only the sections it reads. Every key, its type, default and allowed
// values are in docs/CONFIG.md. Loading rejects unknown keys and bad values with a
// ConfigError naming the key; nothing outside the parser compares config text.
#pragma once
#include <string>
#include <vector>

#include "config/checkpoint_config.h"
#include "config/data_config.h"
#include "config/metrics_config.h"
#include "config/model_config.h"
#include "config/optimizer_config.h"
#include "config/parallel_config.h"
#include "config/training_config.h"

namespace moe {

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
// training.fp8_gemm_backend (`precision` fp8) or training.bf16_gemm_backend (bf16) as a
// launch resolves it: an explicit choice as given; auto becomes deepgemm for a GPU run of
// that precision that allows it (no expert parallelism, parallel.comm_sms = 0, at most 256
// experts) and pads little (~64 rows an expert at most 15% of a micro-batch's routed rows)
// where `deepgemm_runs` (this GPU runs DeepGEMM's kernels, the run is on it), else cutlass.
GemmBackend gemm_backend_for(const RunConfig& config, TrainingPrecision precision, bool deepgemm_runs);
// The config as TOML, every key written (round-trips through parse_config).
std::string config_to_toml(const RunConfig& config);

}  // namespace moe
