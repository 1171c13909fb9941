// The GPU backend's routing metrics: its device counters turned into the LayerRouting
// records the CPU reference reports (kept rows after capacity, drops, entropy, the bias and
// temperature the step routed with).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "config/model_config.h"
#include "model/cuda/gpu_transformer.h"
#include "model/moe_layer.h"
#include "obs/metrics.h"

namespace moe {

// routing: the step's counters (summed over the data-parallel ranks); load_LE: assignments
// per expert before dropping, per MoE layer, whose largest imbalance goes to load_imbalance;
// a2a_fp8: MoE layer i's exchange row format, 1 fp8 or 0 (empty: -1, no expert parallelism).
std::vector<LayerRouting> gpu_layer_routing(const GpuRoutingStats& routing, const std::vector<std::vector<int64_t>>& load_LE,
                                            const std::vector<MoELayer<float>*>& host_layers,
                                            const ModelConfig& config, const std::function<int(int)>& a2a_fp8,
                                            double& load_imbalance);

// Data parallelism: routing's counters and load_LE summed over the ranks by `sum`.
void sum_routing_over_ranks(GpuRoutingStats& routing, std::vector<std::vector<int64_t>>& load_LE,
                            const std::function<void(double*, int64_t)>& sum);

}  // namespace moe
