// The [metrics] section: console, JSONL/TensorBoard output, MFU and alerts
// (docs/CONFIG.md describes every key).
#pragma once
#include <cstdint>
#include <string>

namespace moe {

struct MetricsConfig {
  int64_t log_interval = 10;          // console line every N steps
  std::string dir = "";               // per-run output folder ("" : none)
  bool tensorboard = true;            // also write TensorBoard event files into dir
  double peak_tflops = 989.0;         // peak dense TFLOP/s per device, for MFU (H100/H200 bf16)
  double alert_imbalance = 0.15;      // alert when expert load max/mean - 1 exceeds this
  double alert_comm_wait = 0.20;      // alert when communication wait exceeds this share of a step
  double alert_grad_sync_ms = 5.0;    // alert when gradient-sync latency exceeds this
  bool phase_times = false;           // GPU: log each step's time per phase (CUDA events on the model's stream)
  bool trace = false;                 // write dir/trace.json: each step's phases as Chrome/Perfetto trace events
};

}  // namespace moe
