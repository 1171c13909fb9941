// Threshold alerts on the step metrics, one message per episode: an alert is raised on
// the first step a metric crosses its threshold and cleared on the first step it is
// back under; the steps in between raise nothing.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "obs/metrics.h"

namespace moe {

struct AlertThresholds {
  double imbalance = 0.15;    // max/mean - 1 of tokens per expert, worst MoE layer
  double comm_wait = 0.20;    // communication wait / step time
  double grad_sync_ms = 5.0;  // gradient synchronisation latency
};

struct AlertEvent {
  int64_t step = 0;
  std::string kind;       // "imbalance", "comm_wait", "grad_sync"
  bool raised = true;     // false: the episode ended at this step
  double value = 0, threshold = 0;
  std::string message;    // one line for the console and the dashboard
};

class AlertMonitor {
 public:
  explicit AlertMonitor(AlertThresholds thresholds) : thresholds_(thresholds) {}
  // The alerts raised or cleared by this step.
  std::vector<AlertEvent> check(const StepMetrics& m);
  bool active(const std::string& kind) const;

 private:
  AlertThresholds thresholds_;
  std::vector<std::string> active_;
};

nlohmann::json to_json(const AlertEvent& alert);

}  // namespace moe
