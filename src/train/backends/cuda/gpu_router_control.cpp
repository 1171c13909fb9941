#include "train/backends/cuda/gpu_router_control.h"

#include "core/error.h"
#include "moe/router.h"

namespace moe {

void upload_router_state(const std::vector<MoELayer<float>*>& layers, const ModelConfig& config,
                         GpuTransformer::Routing& routing) {
  for (size_t i = 0; i < layers.size(); ++i) routing.set_temperature(i, static_cast<float>(layers[i]->temperature()));
  if (!config.moe.bias_balancing) return;
  for (size_t i = 0; i < layers.size(); ++i) routing.set_balance_bias(i, layers[i]->balance_bias_E());
}

void update_router_state(const std::vector<MoELayer<float>*>& layers, const std::vector<std::vector<int64_t>>& load_LE,
                         const ModelConfig& config, double alert_imbalance, GpuTransformer::Routing& routing) {
  if (!config.moe.bias_balancing && !config.moe.temperature_control) return;
  MOE_CHECK(load_LE.size() == layers.size(), "router state: loads of {} MoE layers for {}", load_LE.size(),
            layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    if (config.moe.bias_balancing) {
      std::vector<float>& bias = layers[i]->balance_bias_E();
      bias_balance_update(bias.data(), load_LE[i].data(), static_cast<int64_t>(bias.size()),
                          config.moe.bias_update_rate);
      routing.set_balance_bias(i, bias);
    }
    if (config.moe.temperature_control) {
      layers[i]->set_load(load_LE[i]);
      layers[i]->update_temperature(alert_imbalance);
      routing.set_temperature(i, static_cast<float>(layers[i]->temperature()));
    }
  }
}

}  // namespace moe
