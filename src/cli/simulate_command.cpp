// `moe plan --simulate`: the step-time model of train/step_simulator.h over a hardware
// description, flat and hierarchical all-to-all side by side (docs/SIMULATOR.md).
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "cli/plan_command.h"
#include "config/run_config.h"
#include "core/error.h"
#include "train/hardware_description.h"
#include "train/step_simulator.h"

namespace moe {
namespace {

nlohmann::ordered_json prediction_json(const StepPrediction& p) {
  return {{"all_to_all", std::string(name_of(p.layout.all_to_all))},
          {"attention_ms", p.attention},
          {"experts_ms", p.experts},
          {"dense_ms", p.dense},
          {"lm_head_ms", p.lm_head},
          {"memory_ms", p.memory},
          {"compute_ms", p.compute},
          {"optimizer_ms", p.optimizer},
          {"a2a_ms", p.a2a},
          {"exchange_ms", p.exchange.ms},
          {"exchange_intra_bytes", p.exchange.intra_bytes},
          {"exchange_inter_bytes", p.exchange.inter_bytes},
          {"exchange_intra_messages", p.exchange.intra_messages},
          {"exchange_inter_messages", p.exchange.inter_messages},
          {"grad_sync_ms", p.grad_sync},
          {"grad_sync_exposed_ms", p.grad_sync_exposed},
          {"overlap_cost_ms", p.overlap_cost},
          {"weight_gather_ms", p.weight_gather},
          {"weight_gather_exposed_ms", p.weight_gather_exposed},
          {"step_ms", p.step},
          {"comm_share", p.comm_share},
          {"efficiency", p.efficiency},
          {"tokens_per_s_per_gpu", p.tokens_per_s_per_gpu}};
}

}  // namespace

int run_simulate(const PlanOptions& options, std::ostream& out) {
  if (options.hardware.empty()) MOE_CONFIG_ERROR("--simulate needs --hardware FILE (configs/hardware/*.toml)");
  const RunConfig config = load_config(options.config_path, options.overrides);
  const HardwareDescription hw = load_hardware_description(options.hardware);
  const int64_t gpus = options.gpus.value_or(1);
  const int64_t per_node = options.gpus_per_node.value_or(std::min(hw.gpus_per_node, gpus));
  ComputeRates rates = rates_from_hardware(hw);
  std::string compute_from = fmt::format("{}'s peaks x efficiencies ({:.0f} TFLOP/s x {:.2f}, {:.2f} TB/s x {:.2f})",
                                         hw.name, hw.peak_tflops, hw.matmul_efficiency, hw.hbm_tb_s,
                                         hw.memory_efficiency);
  if (!options.compute.empty()) {
    const ComputeProfile profile = load_compute_profile(options.compute);
    rates = rates_from_profile(profile, hw);
    compute_from = fmt::format("profile {} ({}), peaks {:.0f} TFLOP/s / {:.2f} TB/s moved to {:.0f} / {:.2f}",
                               options.compute, profile.source, profile.peak_tflops, profile.hbm_tb_s, hw.peak_tflops,
                               hw.hbm_tb_s);
  }
  MeasuredCollectives measured;
  if (!options.collectives.empty()) measured = load_measured_collectives(options.collectives);
  const std::string collectives_from = fmt::format("{}", fmt::join(options.collectives, ", "));

  SimLayout layout;
  layout.gpus = gpus;
  layout.gpus_per_node = per_node;
  layout.expert_parallel = config.model.moe.n_experts > 0 ? std::min(std::max<int64_t>(config.parallel.expert_parallel, 1), gpus) : 1;
  layout.zero = config.parallel.zero;
  const int64_t tokens = config.training.micro_batch * config.model.seq_len;
  layout.micro_batches =
      options.micro_batches.value_or(std::max<int64_t>(1, config.training.global_batch_tokens / (gpus * tokens)));
  layout.expert_imbalance = options.expert_imbalance;
  if (options.expert_load_imbalance)
    layout.expert_imbalance = rank_imbalance_of_expert_imbalance(
        *options.expert_load_imbalance, std::max<int64_t>(config.model.moe.n_experts, 1),
        std::max<int64_t>(config.model.moe.top_k, 1), layout.expert_parallel);
  if (!options.expert_loads.empty()) {
    const ExpertLoads loads = load_expert_loads(options.expert_loads);
    if (loads.n_experts != config.model.moe.n_experts)
      MOE_CONFIG_ERROR("--expert-loads {}: {} experts logged, the config has moe.n_experts = {}", options.expert_loads,
                       loads.n_experts, config.model.moe.n_experts);
    layout.expert_imbalance = rank_imbalance_of_expert_loads(loads.tokens_RE, layout.expert_parallel);
  }
  std::vector<StepPrediction> predictions;
  for (const AllToAllKind kind : {AllToAllKind::Flat, AllToAllKind::Hierarchical}) {
    layout.all_to_all = kind;
    predictions.push_back(simulate_step(config, layout, hw, rates, measured));
  }
  const StepPrediction& f = predictions[0];
  const StepPrediction& h = predictions[1];

  if (options.json) {
    nlohmann::ordered_json j;
    j["hardware"] = hw.name;
    j["compute"] = compute_from;
    j["measured_intra_a2a_gb_s"] = measured.intra_all_to_all_bytes_per_s / 1e9;
    j["gpus"] = gpus;
    j["gpus_per_node"] = per_node;
    j["expert_parallel"] = layout.expert_parallel;
    j["ep_nodes"] = f.ep_nodes;
    j["zero"] = layout.zero;
    j["micro_batches"] = layout.micro_batches;
    j["tokens_per_micro_batch"] = tokens;
    j["expert_imbalance"] = layout.expert_imbalance;
    if (options.expert_load_imbalance) j["expert_load_imbalance"] = *options.expert_load_imbalance;
    if (!options.expert_loads.empty()) j["expert_loads"] = options.expert_loads;
    j["rows_same_node"] = f.rows.same_node;
    j["rows_other_nodes"] = f.rows.other_nodes;
    j["rows_node_distinct"] = f.rows.node_distinct;
    j["grad_bytes"] = f.grad_bytes;
    j["exchanges_per_step"] = f.exchanges;
    j["a2a_row_bytes_per_step"] = f.a2a_row_bytes;
    j["flat"] = prediction_json(f);
    j["hierarchical"] = prediction_json(h);
    out << j.dump(2) << "\n";
    return 0;
  }
  const ModelConfig& mc = config.model;
  fmt::print(out, "simulate: {}; {} GPU{} in nodes of {}; expert_parallel {} ({} node{} x {}), data parallel {}, "
                  "expert replicas {}, zero {}; per GPU {} micro-batch{} of {} tokens per step\n",
             hw.name, gpus, gpus == 1 ? "" : "s", per_node, layout.expert_parallel, f.ep_nodes,
             f.ep_nodes == 1 ? "" : "s", f.ep_ranks_per_node, gpus, gpus / layout.expert_parallel, layout.zero,
             layout.micro_batches, layout.micro_batches == 1 ? "" : "es", tokens);
  fmt::print(out, "compute: {}\n", compute_from);
  if (options.expert_load_imbalance)
    fmt::print(out, "expert rows: per-expert imbalance {:.3f} -> the busiest rank's rows {:.3f} x the mean\n",
               *options.expert_load_imbalance, 1 + layout.expert_imbalance);
  if (!options.expert_loads.empty())
    fmt::print(out, "expert rows: the busiest rank's {:.3f} x the mean, from the tokens_per_expert logged in {}\n",
               1 + layout.expert_imbalance, options.expert_loads);
  if (measured.intra_all_to_all_bytes_per_s > 0)
    fmt::print(out, "all-to-all inside a node: measured {:.1f} GB/s ({})\n", measured.intra_all_to_all_bytes_per_s / 1e9,
               collectives_from);
  if (measured.intra_all_reduce_bus_bytes_per_s > 0)
    fmt::print(out, "reductions inside a node: measured all-reduce bus bandwidth {:.1f} GB/s, {:.1f} us per call ({})\n",
               measured.intra_all_reduce_bus_bytes_per_s / 1e9, measured.intra_all_reduce_latency_us, collectives_from);
  if (mc.moe.n_experts > 0 && layout.expert_parallel > 1)
    fmt::print(out, "rows per token per exchange (one per rank holding any of its top-{} experts): {:.3f} to the node's "
                    "other ranks, {:.3f} to other nodes (a per-node deduplicating exchange: {:.3f}){}\n",
               mc.moe.top_k, f.rows.same_node, f.rows.other_nodes, f.rows.node_distinct,
               mc.moe.route_groups > 1 ? fmt::format("; node-first routing, {} of {} groups", mc.moe.route_top_groups,
                                                     mc.moe.route_groups)
                                       : "");
  fmt::print(out, "one exchange per rank: flat {:.2f} MB intra + {:.2f} MB inter, {} + {} messages, {:.3f} ms; "
                  "hierarchical {:.2f} MB intra + {:.2f} MB inter, {} + {} messages, {:.3f} ms\n",
             f.exchange.intra_bytes / 1e6, f.exchange.inter_bytes / 1e6, f.exchange.intra_messages,
             f.exchange.inter_messages, f.exchange.ms, h.exchange.intra_bytes / 1e6, h.exchange.inter_bytes / 1e6,
             h.exchange.intra_messages, h.exchange.inter_messages, h.exchange.ms);
  fmt::print(out, "{:<34} {:>12} {:>14}\n", "ms per step (busiest rank)", "flat", "hierarchical");
  auto row = [&](const char* name, double a, double b) { fmt::print(out, "  {:<32} {:>12.1f} {:>14.1f}\n", name, a, b); };
  row("attention", f.attention, h.attention);
  row("experts + router", f.experts, h.experts);
  if (f.dense > 0) row("dense FFN", f.dense, h.dense);
  row("LM head + loss", f.lm_head, h.lm_head);
  row("memory-bound (norms, dispatch)", f.memory, h.memory);
  row("compute", f.compute, h.compute);
  row("optimizer", f.optimizer, h.optimizer);
  row("all-to-all (not overlapped)", f.a2a, h.a2a);
  row("gradient sync, exposed", f.grad_sync_exposed, h.grad_sync_exposed);
  fmt::print(out, "  {:<32} {:>12} {:>14}\n", "  (in all, under the backward)", fmt::format("{:.1f}", f.grad_sync),
             fmt::format("{:.1f}", h.grad_sync));
  if (layout.zero >= 1) row("ZeRO weight all-gather, exposed", f.weight_gather_exposed, h.weight_gather_exposed);
  row("compute lost beside collectives", f.overlap_cost, h.overlap_cost);
  row("step", f.step, h.step);
  fmt::print(out, "  {:<32} {:>11.1f}% {:>13.1f}%\n", "communication share", 100 * f.comm_share, 100 * h.comm_share);
  fmt::print(out, "  {:<32} {:>11.1f}% {:>13.1f}%\n", "weak-scaling efficiency (*)", 100 * f.efficiency,
             100 * h.efficiency);
  fmt::print(out, "  {:<32} {:>12.0f} {:>14.0f}\n", "tokens/s per GPU", f.tokens_per_s_per_gpu, h.tokens_per_s_per_gpu);
  fmt::print(out, "(*) this step against the same per-GPU work with free communication and even expert rows\n");
  return 0;
}

}  // namespace moe
