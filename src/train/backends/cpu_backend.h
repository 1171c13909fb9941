// The CPU reference backend: Transformer<float> and AdamW in this process.
#pragma once
#include <memory>
#include <vector>

#include "config/run_config.h"
#include "train/backends/model_backend.h"

namespace moe {

std::unique_ptr<ModelBackend> make_cpu_backend(const RunConfig& config, HostState host);

// The host model's activation arenas for training.micro_batch, halved while over
// training.memory_limit_mb (or while an allocation fails). Shared by the CPU backends.
BatchPlan plan_host_batches(const RunConfig& config, Transformer<float>& model);

// The step's routing per MoE layer of the host model (kept tokens per expert, drops,
// entropy, bias) and, into load_imbalance, the largest imbalance before dropping.
std::vector<LayerRouting> host_routing(Transformer<float>& model, const ModelConfig& config, double& load_imbalance);

class RoutingCacheProbe;
// moe.route_cache: the host model's last forward (its tokens inputs_BS and every MoE
// layer's choices) into the probe.
void probe_routing(Transformer<float>& model, RoutingCacheProbe& probe, const int32_t* inputs_BS);

}  // namespace moe
