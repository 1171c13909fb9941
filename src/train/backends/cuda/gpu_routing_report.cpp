#include "train/backends/cuda/gpu_routing_report.h"

#include <algorithm>
#include <cmath>

namespace moe {

std::vector<LayerRouting> gpu_layer_routing(const GpuRoutingStats& routing, const std::vector<std::vector<int64_t>>& load_LE,
                                            const std::vector<MoELayer<float>*>& host_layers,
                                            const ModelConfig& config, const std::function<int(int)>& a2a_fp8,
                                            double& load_imbalance) {
  std::vector<LayerRouting> layers;
  for (size_t i = 0; i < load_LE.size(); ++i) {
    LayerRouting r;
    r.layer = config.first_dense_layers + static_cast<int64_t>(i);
    r.tokens_E = routing.kept[i];  // after capacity, as the CPU reports it
    r.assignments = routing.tokens[i] * config.moe.top_k;
    int64_t kept = 0;
    for (int64_t rows : routing.kept[i]) kept += rows;
    r.dropped = r.assignments - kept;
    r.router_entropy = routing.tokens[i] > 0 ? routing.entropy_sum[i] / static_cast<double>(routing.tokens[i]) : 0;
    // Imbalance before dropping, as the CPU's.
    load_imbalance = std::max(load_imbalance, moe::load_imbalance(load_LE[i]));
    // The bias the step routed with, as the CPU reports it (before this step's update).
    if (config.moe.bias_balancing)
      r.bias_E.assign(host_layers[i]->balance_bias_E().begin(), host_layers[i]->balance_bias_E().end());
    r.a2a_fp8 = a2a_fp8 ? a2a_fp8(static_cast<int>(i)) : -1;
    if (a2a_fp8 && i < routing.dispatch_wait_s.size()) r.a2a_dispatch_wait_ms = routing.dispatch_wait_s[i] * 1e3;
    if (config.moe.speculative_dispatch && a2a_fp8 && i > 0 && i < routing.speculation.size()) {
      r.spec_rows_used = routing.speculation[i].used;
      r.spec_rows_wasted = routing.speculation[i].wasted;
      r.spec_rows_corrected = routing.speculation[i].corrected;
    }
    r.temperature = host_layers[i]->temperature();
    layers.push_back(std::move(r));
  }
  return layers;
}

void sum_routing_over_ranks(GpuRoutingStats& routing, std::vector<std::vector<int64_t>>& load_LE,
                            const std::function<void(double*, int64_t)>& sum) {
  // One sum: the loads, kept rows, entropies, tokens, the speculation's rows and the
  // dispatch waits (averaged by the caller).
  std::vector<double> flat;
  for (const auto& layer : load_LE) flat.insert(flat.end(), layer.begin(), layer.end());
  for (const auto& layer : routing.kept) flat.insert(flat.end(), layer.begin(), layer.end());
  flat.insert(flat.end(), routing.entropy_sum.begin(), routing.entropy_sum.end());
  flat.insert(flat.end(), routing.tokens.begin(), routing.tokens.end());
  for (const SpeculationRows& r : routing.speculation)
    flat.insert(flat.end(), {static_cast<double>(r.used), static_cast<double>(r.wasted), static_cast<double>(r.corrected)});
  flat.insert(flat.end(), routing.dispatch_wait_s.begin(), routing.dispatch_wait_s.end());
  sum(flat.data(), static_cast<int64_t>(flat.size()));
  size_t k = 0;
  for (auto& layer : load_LE)
    for (auto& load : layer) load = std::llround(flat[k++]);
  for (auto& layer : routing.kept)
    for (auto& kept : layer) kept = std::llround(flat[k++]);
  for (auto& entropy : routing.entropy_sum) entropy = flat[k++];
  for (auto& tokens : routing.tokens) tokens = std::llround(flat[k++]);
  for (SpeculationRows& r : routing.speculation) {
    r.used = std::llround(flat[k++]);
    r.wasted = std::llround(flat[k++]);
    r.corrected = std::llround(flat[k++]);
  }
  for (double& wait : routing.dispatch_wait_s) wait = flat[k++];
}

}  // namespace moe
