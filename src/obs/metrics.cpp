#include "obs/metrics.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

namespace moe {

double load_imbalance(const std::vector<int64_t>& load_E) {
  int64_t total = 0, max_load = 0;
  for (int64_t l : load_E) {
    total += l;
    max_load = std::max(max_load, l);
  }
  if (total == 0) return 0;
  const double mean = static_cast<double>(total) / static_cast<double>(load_E.size());
  return static_cast<double>(max_load) / mean - 1.0;
}

double load_cv(const std::vector<int64_t>& load_E) {
  if (load_E.empty()) return 0;
  double total = 0;
  for (int64_t l : load_E) total += static_cast<double>(l);
  if (total == 0) return 0;
  const double n = static_cast<double>(load_E.size());
  const double mean = total / n;
  double sq = 0;
  for (int64_t l : load_E) sq += (static_cast<double>(l) - mean) * (static_cast<double>(l) - mean);
  return std::sqrt(sq / n) / mean;
}

double LayerRouting::dropped_fraction() const {
  return assignments > 0 ? static_cast<double>(dropped) / static_cast<double>(assignments) : 0;
}

double StepMetrics::max_imbalance() const {
  double worst = 0;
  for (const auto& layer : layers) worst = std::max(worst, layer.imbalance());
  return worst;
}

double MfuInputs::flops_per_token() const {
  return 6.0 * static_cast<double>(active_non_embedding_params) +
         12.0 * static_cast<double>(n_layers) * static_cast<double>(dim) * static_cast<double>(seq_len);
}

double MfuInputs::mfu(double tokens_per_s) const {
  return peak_flops > 0 ? tokens_per_s * flops_per_token() / peak_flops : 0;
}

std::string MfuInputs::describe() const {
  if (peak_flops <= 0)
    return fmt::format("flops/token = 6 x {} active non-embedding params + 12 x {} layers x {} dim x {} seq = {:.4g} "
                       "| not reported: no peak figure for this device (metrics.peak_tflops is a GPU's)",
                       active_non_embedding_params, n_layers, dim, seq_len, flops_per_token());
  return fmt::format("flops/token = 6 x {} active non-embedding params + 12 x {} layers x {} dim x {} seq = "
                     "{:.4g} | peak {:.4g} TFLOP/s | mfu = tok/s x flops/token / peak",
                     active_non_embedding_params, n_layers, dim, seq_len, flops_per_token(), peak_flops / 1e12);
}

int64_t resident_set_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages_total = 0, pages_resident = 0;
  if (!(statm >> pages_total >> pages_resident)) return 0;
  return pages_resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

nlohmann::json to_json(const RunInfo& info) {
  return {
      {"type", "run"},
      {"run_id", info.run_id},
      {"steps", info.steps},
      {"first_step", info.first_step},
      {"tokens_per_step", info.tokens_per_step},
      {"n_layers", info.n_layers},
      {"moe_layers", info.moe_layers},
      {"n_experts", info.n_experts},
      {"top_k", info.top_k},
      {"world_size", info.world_size},
      {"params_total", info.params_total},
      {"params_active", info.params_active},
      {"bias_balancing", info.bias_balancing},
      {"temperature_control", info.temperature_control},
      {"mfu_inputs",
       {{"active_non_embedding_params", info.mfu.active_non_embedding_params},
        {"n_layers", info.mfu.n_layers},
        {"dim", info.mfu.dim},
        {"seq_len", info.mfu.seq_len},
        {"flops_per_token", info.mfu.flops_per_token()},
        {"peak_flops", info.mfu.peak_flops}}},
  };
}

nlohmann::json to_json(const StepMetrics& m) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : m.layers) {
    nlohmann::json layer = {
        {"layer", l.layer},
        {"tokens_per_expert", l.tokens_E},
        {"imbalance", l.imbalance()},
        {"cv", l.cv()},
        {"dropped", l.dropped},
        {"dropped_fraction", l.dropped_fraction()},
        {"router_entropy", l.router_entropy},
    };
    if (!l.bias_E.empty()) layer["bias"] = l.bias_E;
    if (l.route_cache_hit_rate >= 0) {
      layer["route_cache_hit_rate"] = l.route_cache_hit_rate;
      layer["route_cache_token_hit_rate"] = l.route_cache_token_hit_rate;
    }
    if (l.a2a_fp8 >= 0) layer["a2a_fp8"] = l.a2a_fp8;
    if (l.a2a_dispatch_wait_ms >= 0) layer["a2a_dispatch_wait_ms"] = l.a2a_dispatch_wait_ms;
    if (l.spec_rows_used >= 0) {
      layer["spec_rows_used"] = l.spec_rows_used;
      layer["spec_rows_wasted"] = l.spec_rows_wasted;
      layer["spec_rows_corrected"] = l.spec_rows_corrected;
      layer["spec_used_share"] = l.spec_used_share();
    }
    if (l.temperature > 0) layer["temperature"] = l.temperature;
    if (!l.merges.empty()) {
      nlohmann::json merges = nlohmann::json::array();
      for (const MergeRecord& r : l.merges)
        merges.push_back({{"kept", r.kept}, {"freed", r.freed}, {"split_of", r.split_of},
                          {"similarity", r.similarity}, {"kept_share", r.kept_share}});
      layer["merges"] = std::move(merges);
    }
    layers.push_back(std::move(layer));
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : m.ranks) ranks.push_back({{"rank", r.rank}, {"experts", r.experts}, {"load", r.load}});
  nlohmann::json j = {
      {"type", "step"},
      {"step", m.step},
      {"steps", m.steps},
      {"wall_time", m.wall_time},
      {"loss", m.loss},
      {"aux_loss", m.aux_loss},
      {"z_loss", m.z_loss},
      {"lr", m.lr},
      {"grad_norm", m.grad_norm},
      {"max_expert_grad_norm", m.max_expert_grad_norm},
      {"skipped", m.skipped},
      {"tokens", m.tokens},
      {"tokens_per_s", m.tokens_per_s},
      {"mfu", m.mfu},
      {"time_s",
       {{"step", m.time.step},
        {"compute", m.time.compute},
        {"comm_wait", m.time.comm_wait},
        {"data_wait", m.time.data_wait},
        {"optimizer", m.time.optimizer}}},
      {"comm_wait_fraction", m.comm_wait_fraction()},
      {"grad_sync_ms", m.grad_sync_ms},
      {"a2a_bytes", m.a2a_bytes},
      {"a2a_off_node_bytes", m.a2a_off_node_bytes},
      {"a2a_gb_per_s", m.a2a_bandwidth / 1e9},
      {"memory", {{"arena_bytes", m.arena_bytes}, {"rss_bytes", m.rss_bytes}}},
      {"max_imbalance", m.max_imbalance()},
      {"layers", std::move(layers)},
      {"ranks", std::move(ranks)},
  };
  if (!m.phase_ms.empty()) {
    nlohmann::json phases = nlohmann::json::object();
    for (const auto& [phase, ms] : m.phase_ms) phases[phase] = ms;
    j["phase_ms"] = std::move(phases);
  }
  if (m.board.samples > 0)
    j["board"] = {{"sm_clock_mhz", m.board.sm_mhz_mean},
                  {"power_w", m.board.power_w_mean},
                  {"power_capped", m.board.power_capped},
                  {"samples", m.board.samples}};
  if (m.board.sm_mhz_counted > 0) j["board"]["sm_clock_counted_mhz"] = m.board.sm_mhz_counted;
  return j;
}

}  // namespace moe
