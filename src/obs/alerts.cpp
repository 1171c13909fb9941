#include "obs/alerts.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

namespace moe {

std::vector<AlertEvent> AlertMonitor::check(const StepMetrics& m) {
  // The worst MoE layer names where the imbalance is.
  int64_t worst_layer = -1;
  double worst = 0;
  for (const auto& layer : m.layers)
    if (layer.imbalance() > worst || worst_layer < 0) worst = layer.imbalance(), worst_layer = layer.layer;
  struct Check {
    const char* kind;
    double value, threshold;
    std::string what;
  };
  const Check checks[] = {
      {"imbalance", worst, thresholds_.imbalance,
       fmt::format("expert load imbalance {:.1f}% (layer {}, max/mean - 1)", worst * 100, worst_layer)},
      {"comm_wait", m.comm_wait_fraction(), thresholds_.comm_wait,
       fmt::format("communication wait {:.1f}% of the step", m.comm_wait_fraction() * 100)},
      {"grad_sync", m.grad_sync_ms, thresholds_.grad_sync_ms,
       fmt::format("gradient-sync latency {:.2f} ms", m.grad_sync_ms)},
  };
  std::vector<AlertEvent> events;
  for (const Check& c : checks) {
    if (c.kind == std::string("imbalance") && m.layers.empty()) continue;
    const bool over = c.value > c.threshold;
    auto it = std::find(active_.begin(), active_.end(), c.kind);
    const bool was_active = it != active_.end();
    if (over == was_active) continue;
    AlertEvent e{m.step, c.kind, over, c.value, c.threshold, ""};
    const bool percent = e.kind != "grad_sync";
    const std::string limit = percent ? fmt::format("{:.1f}%", c.threshold * 100) : fmt::format("{:.2f} ms", c.threshold);
    if (over) {
      e.message = fmt::format("alert: step {}: {} > {}", m.step, c.what, limit);
      active_.push_back(c.kind);
    } else {
      e.message = fmt::format("alert cleared: step {}: {} <= {}", m.step, c.what, limit);
      active_.erase(it);
    }
    events.push_back(std::move(e));
  }
  return events;
}

bool AlertMonitor::active(const std::string& kind) const {
  return std::find(active_.begin(), active_.end(), kind) != active_.end();
}

nlohmann::json to_json(const AlertEvent& a) {
  return {{"type", "alert"}, {"step", a.step},        {"kind", a.kind},      {"raised", a.raised},
          {"value", a.value}, {"threshold", a.threshold}, {"message", a.message}};
}

}  // namespace moe
