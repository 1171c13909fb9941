// The routers' state between the host and the GPU model: MoELayer keeps the master copies of
// the balancing bias and the router temperature (checkpoints save them; the CPU's rules
// update them) and the GPU model's routers read device copies (GpuTransformer::Routing).
#pragma once
#include <cstdint>
#include <vector>

#include "config/model_config.h"
#include "model/cuda/gpu_transformer.h"
#include "model/moe_layer.h"

namespace moe {

// Every MoE layer's temperature and, with moe.bias_balancing, its bias onto the device (after
// the GPU model is (re)built, a checkpoint restored or experts merged).
void upload_router_state(const std::vector<MoELayer<float>*>& layers, const ModelConfig& config,
                         GpuTransformer::Routing& routing);

// A step's rules on its loads (load_LE: assignments per expert and MoE layer, summed over the
// ranks, so that every replica takes the same values), as the CPU's data-parallel path runs
// them: MoELayer's bias update (moe.bias_balancing) and temperature controller
// (moe.temperature_control, towards alert_imbalance), each result uploaded.
void update_router_state(const std::vector<MoELayer<float>*>& layers, const std::vector<std::vector<int64_t>>& load_LE,
                         const ModelConfig& config, double alert_imbalance, GpuTransformer::Routing& routing);

}  // namespace moe
