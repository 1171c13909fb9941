#include "cli/plan_command.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>

#include "config/run_config.h"
#include "core/error.h"
#include "model/transformer.h"
#include "train/backends/backend_factory.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

namespace moe {
namespace {

double gb(int64_t bytes) { return static_cast<double>(bytes) / 1e9; }

std::string count_text(int64_t n) {
  const auto x = static_cast<double>(n);
  return n >= 1'000'000'000 ? fmt::format("{:.2f} B", x / 1e9) : fmt::format("{:.2f} M", x / 1e6);
}

std::string recompute_text(const MemoryLayout& l, int64_t n_layers) {
  const int64_t layers = l.recompute_layers < 0 ? n_layers : std::min(l.recompute_layers, n_layers);
  const std::string experts =
      l.recompute_experts_layers < 0
          ? fmt::format("experts {}", name_of(l.recompute_experts))
          : fmt::format("experts {} ({} MoE layer{})", name_of(l.recompute_experts), l.recompute_experts_layers,
                        l.recompute_experts_layers == 1 ? "" : "s");
  if (layers == 0) return l.recompute_experts == ExpertRecompute::None ? "none" : experts;
  std::string text = layers == n_layers ? "all layers" : fmt::format("{} layers", layers);
  if (l.recompute_experts != ExpertRecompute::None) text += ", " + experts;
  return text;
}

// The recomputation, and the ordered attention backward where the layout takes it.
std::string savers_text(const MemoryLayout& l, int64_t n_layers) {
  return recompute_text(l, n_layers) + (l.ordered_attention ? "; dQ ordered" : "");
}

// "layers 0-15: 1.912 GB each" runs of equal layers.
std::string activations_by_layer(const MemoryEstimate& e) {
  std::string text;
  const auto& layers = e.layer_activations;
  for (size_t first = 0; first < layers.size();) {
    size_t last = first;
    while (last + 1 < layers.size() && layers[last + 1] == layers[first]) ++last;
    text += fmt::format("{}{} {:.3f} GB{}", text.empty() ? "" : "; ",
                        first == last ? fmt::format("layer {}:", first) : fmt::format("layers {}-{}:", first, last),
                        gb(layers[first]), first == last ? "" : " each");
    first = last + 1;
  }
  if (e.recompute_set > 0) text += fmt::format("; the recompute set {:.3f} GB", gb(e.recompute_set));
  return text;
}

}  // namespace

int run_plan(const PlanOptions& options, std::ostream& out) {
  if (options.simulate) return run_simulate(options, out);
  if (!options.hardware.empty() || !options.compute.empty() || !options.collectives.empty() || options.json ||
      options.micro_batches || options.expert_imbalance != 0 || options.expert_load_imbalance ||
      !options.expert_loads.empty())
    MOE_CONFIG_ERROR("--hardware, --compute, --collectives, --micro-batches, --expert-imbalance, "
                     "--expert-load-imbalance, --expert-loads and --json go with --simulate");
  RunConfig config = load_config(options.config_path, options.overrides);
  // The target's GPUs, not this host's: the plan is for H100 / H200 SXM boards (the memory
  // default is an H200's), which run DeepGEMM's kernels, so `auto` plans them where the run
  // allows them (the padding rows, gate|up interleaved) even on a host without a GPU.
  resolve_gemm_backends(config, /*deepgemm_runs=*/true);
  const ModelConfig& mc = config.model;
  const int64_t gpus = options.gpus.value_or(std::max<int64_t>(1, config.parallel.expert_parallel));
  if (gpus < 1) MOE_CONFIG_ERROR("--gpus {}: at least 1", gpus);
  const int64_t per_node = options.gpus_per_node.value_or(std::min<int64_t>(8, gpus));
  if (per_node < 1) MOE_CONFIG_ERROR("--gpus-per-node {}: at least 1", per_node);
  const double memory_gb = options.gpu_memory_gb.value_or(kDefaultGpuMemoryGb);
  if (!(memory_gb > kMemoryReserveGb))
    MOE_CONFIG_ERROR("--gpu-memory-gb {}: more than the {} GB reserve", memory_gb, kMemoryReserveGb);
  const auto budget = static_cast<int64_t>((memory_gb - kMemoryReserveGb) * 1e9);

  const MemoryLayout layout = configured_layout(config, gpus, per_node);
  const MemoryEstimate estimate = estimate_memory(config, layout);  // refuses a layout the config cannot take
  const ParameterCounts counts = count_parameters(mc, Transformer<float>::parameter_specs(mc));
  fmt::print(out, "model: {} parameters ({} active), {} layers, dim {}, {} experts top-{}, {} x {} tokens per "
                  "micro-batch\n",
             count_text(counts.total), count_text(counts.active), mc.n_layers, mc.dim,
             mc.moe.n_experts, mc.moe.top_k, config.training.micro_batch, mc.seq_len);
  fmt::print(out, "layout: {} GPU{} ({} per node), expert_parallel {}, zero {}, micro-batch {}, recompute {}; {}\n", gpus,
             gpus == 1 ? "" : "s", per_node, layout.expert_parallel, layout.zero, layout.micro_batch,
             recompute_text(layout, mc.n_layers), name_of(attention_dq_of(config, layout)));
  const TrainingPrecision precision = config.training.precision;
  fmt::print(out, "experts' GEMMs: {} {} (training.{}_gemm_backend; auto plans an H100 / H200 SXM target)\n",
             precision == TrainingPrecision::Fp8 ? "fp8" : "bf16",
             name_of(config.training.gemm_backend(precision)), precision == TrainingPrecision::Fp8 ? "fp8" : "bf16");
  fmt::print(out, "per GPU{:>32}\n", "GB");
  for (const MemoryEstimate::Component& c : estimate.components())
    fmt::print(out, "  {:<30} {:>8.2f}\n", c.name, gb(c.bytes));
  fmt::print(out, "  {:<30} {:>8.2f}\n", "total", gb(estimate.total()));
  fmt::print(out, "activations by layer: {}\n", activations_by_layer(estimate));
  const MemoryEstimate::Component largest = estimate.largest();
  const bool fits = estimate.total() <= budget;
  fmt::print(out, "largest: {} {:.2f} GB; {} in {:.1f} GB ({:.0f} GB less a {:.0f} GB reserve){}\n", largest.name,
             gb(largest.bytes), fits ? "fits" : "does not fit", gb(budget), memory_gb, kMemoryReserveGb,
             fits ? "" : fmt::format(", {:.1f} GB over", gb(estimate.total() - budget)));

  // What `moe train` would say on these GPUs (it judges the smallest micro-batch the halving reaches).
  try {
    check_memory_fits(config, gpus, per_node, 1, budget);
  } catch (const ConfigError& e) {
    fmt::print(out, "moe train refuses it: {}\n", e.what());
  }
  const std::vector<LayoutFit> all = layouts_that_fit(config, gpus, per_node, budget);
  if (all.empty()) {
    fmt::print(out,
               "no layout fits on {} GPU{} (expert_parallel, zero 0-3, micro-batch halvings, recompute, ordered "
               "attention dQ)\n",
               gpus, gpus == 1 ? "" : "s");
    return 0;
  }
  fmt::print(out, "layouts that fit on {} GPU{}, best first ({} of {}):\n", gpus, gpus == 1 ? "" : "s",
             std::min<size_t>(all.size(), static_cast<size_t>(options.max_layouts)), all.size());
  fmt::print(out, "  {:>4} {:>4} {:>11}  {:<44} {:>8}\n", "EP", "ZeRO", "micro-batch", "recompute", "GB/GPU");
  for (size_t i = 0; i < all.size() && i < static_cast<size_t>(options.max_layouts); ++i) {
    const MemoryLayout& l = all[i].layout;
    fmt::print(out, "  {:>4} {:>4} {:>11}  {:<44} {:>8.2f}\n", l.expert_parallel, l.zero, l.micro_batch,
               savers_text(l, mc.n_layers), gb(all[i].estimate.total()));
  }
  return 0;
}

}  // namespace moe
