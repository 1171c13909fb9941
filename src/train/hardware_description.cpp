#include "train/hardware_description.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "core/error.h"

namespace moe {
namespace {

std::string read_text(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) MOE_CONFIG_ERROR("{} {}: cannot be read", what, path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// One section of a hardware file: every key required, of its type and range; none unknown.
class Section {
 public:
  Section(const toml::table& root, std::string name, const std::string& source)
      : name_(std::move(name)), source_(source) {
    const toml::node* node = root.get(name_);
    if (!node || !node->is_table()) MOE_CONFIG_ERROR("hardware {}: [{}] is missing", source_, name_);
    table_ = node->as_table();
  }
  double number(const std::string& key, double low, double high, bool low_open = true) {
    seen_.insert(key);
    const toml::node* node = table_->get(key);
    if (!node) MOE_CONFIG_ERROR("hardware {}: {}.{} is missing", source_, name_, key);
    std::optional<double> v = node->value<double>();
    if (!v || node->is_boolean()) MOE_CONFIG_ERROR("hardware {}: {}.{} must be a number", source_, name_, key);
    if (!(low_open ? *v > low : *v >= low) || !(*v <= high))
      MOE_CONFIG_ERROR("hardware {}: {}.{} = {} is outside {}{}, {}]", source_, name_, key, *v, low_open ? "(" : "[",
                       low, high);
    return *v;
  }
  int64_t integer(const std::string& key, int64_t low, int64_t high) {
    seen_.insert(key);
    const toml::node* node = table_->get(key);
    if (!node) MOE_CONFIG_ERROR("hardware {}: {}.{} is missing", source_, name_, key);
    if (!node->is_integer()) MOE_CONFIG_ERROR("hardware {}: {}.{} must be an integer", source_, name_, key);
    const int64_t v = node->value<int64_t>().value();
    if (v < low || v > high)
      MOE_CONFIG_ERROR("hardware {}: {}.{} = {} is outside [{}, {}]", source_, name_, key, v, low, high);
    return v;
  }
  void no_others() const {
    for (const auto& [key, value] : *table_)
      if (!seen_.count(std::string(key.str())))
        MOE_CONFIG_ERROR("hardware {}: {}.{} is not a key of [{}]", source_, name_, key.str(), name_);
  }

 private:
  std::string name_;
  const std::string& source_;
  const toml::table* table_ = nullptr;
  std::set<std::string> seen_;
};

nlohmann::json parse_json(const std::string& text, const std::string& what, const std::string& source) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MOE_CONFIG_ERROR("{} {}: not JSON ({})", what, source, e.what());
  }
}

double json_number(const nlohmann::json& j, const char* key, const std::string& what, const std::string& source,
                   bool positive = true) {
  if (!j.contains(key) || !j[key].is_number()) MOE_CONFIG_ERROR("{} {}: \"{}\" must be a number", what, source, key);
  const double v = j[key].get<double>();
  if (positive ? !(v > 0) : !(v >= 0)) MOE_CONFIG_ERROR("{} {}: \"{}\" = {} must be {}", what, source, key, v,
                                                       positive ? "positive" : "non-negative");
  return v;
}

}  // namespace

HardwareDescription parse_hardware_description(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(text, std::string_view(source));
  } catch (const toml::parse_error& e) {
    MOE_CONFIG_ERROR("hardware {}: line {}: {}", source, e.source().begin.line, e.description());
  }
  HardwareDescription hw;
  for (const auto& [key, value] : root) {
    const std::string k(key.str());
    if (k != "name" && k != "gpus_per_node" && k != "compute" && k != "intra_node" && k != "inter_node")
      MOE_CONFIG_ERROR("hardware {}: {} is not a key (name, gpus_per_node, [compute], [intra_node], [inter_node])",
                       source, k);
  }
  const std::optional<std::string> name = root["name"].value<std::string>();
  if (!name || name->empty()) MOE_CONFIG_ERROR("hardware {}: name must be a non-empty string", source);
  hw.name = *name;
  const toml::node* per_node = root.get("gpus_per_node");
  if (!per_node || !per_node->is_integer() || per_node->value<int64_t>().value() < 1 ||
      per_node->value<int64_t>().value() > 1024)
    MOE_CONFIG_ERROR("hardware {}: gpus_per_node must be an integer in [1, 1024]", source);
  hw.gpus_per_node = per_node->value<int64_t>().value();
  Section compute(root, "compute", source);
  hw.peak_tflops = compute.number("peak_tflops", 0, 1e6);
  hw.hbm_tb_s = compute.number("hbm_tb_s", 0, 1e3);
  hw.matmul_efficiency = compute.number("matmul_efficiency", 0, 1);
  hw.memory_efficiency = compute.number("memory_efficiency", 0, 1);
  hw.overlap_slowdown = compute.number("overlap_slowdown", 0, 10, false);
  compute.no_others();
  Section intra(root, "intra_node", source);
  hw.intra_bandwidth_gb_s = intra.number("bandwidth_gb_s", 0, 1e5);
  hw.intra_efficiency = intra.number("efficiency", 0, 1);
  hw.intra_latency_us = intra.number("latency_us", 0, 1e6, false);
  intra.no_others();
  Section inter(root, "inter_node", source);
  hw.nics_per_node = inter.integer("nics_per_node", 1, 1024);
  hw.nic_gbit_s = inter.number("nic_gbit_s", 0, 1e6);
  hw.inter_efficiency = inter.number("efficiency", 0, 1);
  hw.inter_latency_us = inter.number("latency_us", 0, 1e6, false);
  inter.no_others();
  return hw;
}

HardwareDescription load_hardware_description(const std::string& path) {
  return parse_hardware_description(read_text(path, "hardware"), path);
}

std::string compute_profile_json(const ComputeProfile& profile) {
  const ModelConfig& m = profile.config.model;
  nlohmann::ordered_json j;
  j["format"] = "moe-compute-profile-1";
  j["source"] = profile.source;
  j["peak_tflops"] = profile.peak_tflops;
  j["hbm_tb_s"] = profile.hbm_tb_s;
  j["model"] = {{"vocab_size", m.vocab_size},
                {"dim", m.dim},
                {"n_layers", m.n_layers},
                {"n_heads", m.n_heads},
                {"n_kv_heads", m.n_kv_heads},
                {"seq_len", m.seq_len},
                {"first_dense_layers", m.first_dense_layers},
                {"dense_hidden", m.dense_hidden},
                {"tie_embeddings", m.tie_embeddings},
                {"n_experts", m.moe.n_experts},
                {"top_k", m.moe.top_k},
                {"expert_hidden", m.moe.expert_hidden},
                {"n_shared_experts", m.moe.n_shared_experts},
                {"router_bias", m.moe.router_bias}};
  j["micro_batch"] = profile.config.training.micro_batch;
  j["moment_bytes"] = moment_bytes_per_element(profile.config.optimizer.state_dtype);
  j["phases_ms"] = nlohmann::ordered_json::object();
  for (const auto& [name, ms] : profile.phase_ms) j["phases_ms"][name] = ms;
  return j.dump(2) + "\n";
}

ComputeProfile parse_compute_profile(const std::string& text, const std::string& source) {
  const std::string what = "compute profile";
  const nlohmann::json j = parse_json(text, what, source);
  if (!j.is_object() || j.value("format", "") != "moe-compute-profile-1")
    MOE_CONFIG_ERROR("{} {}: \"format\" must be \"moe-compute-profile-1\" (moe bench --json)", what, source);
  ComputeProfile p;
  p.source = j.value("source", "");
  p.peak_tflops = json_number(j, "peak_tflops", what, source);
  p.hbm_tb_s = json_number(j, "hbm_tb_s", what, source);
  if (!j.contains("model") || !j["model"].is_object()) MOE_CONFIG_ERROR("{} {}: \"model\" is missing", what, source);
  const nlohmann::json& m = j["model"];
  auto count = [&](const char* key, bool positive) {
    const double v = json_number(m, key, what, source, positive);
    if (v != static_cast<double>(static_cast<int64_t>(v)))
      MOE_CONFIG_ERROR("{} {}: \"{}\" = {} must be an integer", what, source, key, v);
    return static_cast<int64_t>(v);
  };
  ModelConfig& mc = p.config.model;
  mc.vocab_size = count("vocab_size", true);
  mc.dim = count("dim", true);
  mc.n_layers = count("n_layers", true);
  mc.n_heads = count("n_heads", true);
  mc.n_kv_heads = count("n_kv_heads", true);
  mc.seq_len = count("seq_len", true);
  mc.first_dense_layers = count("first_dense_layers", false);
  mc.dense_hidden = count("dense_hidden", false);
  mc.moe.n_experts = count("n_experts", false);
  mc.moe.top_k = count("top_k", false);
  mc.moe.expert_hidden = count("expert_hidden", false);
  mc.moe.n_shared_experts = count("n_shared_experts", false);
  mc.tie_embeddings = m.value("tie_embeddings", false);
  mc.moe.router_bias = m.value("router_bias", true);
  p.config.training.micro_batch = static_cast<int64_t>(json_number(j, "micro_batch", what, source));
  const double moment_bytes = json_number(j, "moment_bytes", what, source);
  const auto dtype = std::find_if(kMomentDtypeNames.begin(), kMomentDtypeNames.end(),
                                  [&](const auto& d) { return moment_bytes_per_element(d.value) == moment_bytes; });
  if (dtype == kMomentDtypeNames.end())
    MOE_CONFIG_ERROR("{} {}: \"moment_bytes\" must be 4, 2 or 1.0625 (fp32, bf16, fp8 moments)", what, source);
  p.config.optimizer.state_dtype = dtype->value;
  if (!j.contains("phases_ms") || !j["phases_ms"].is_object())
    MOE_CONFIG_ERROR("{} {}: \"phases_ms\" must be an object of phase -> ms", what, source);
  for (const auto& [name, ms] : j["phases_ms"].items()) {
    if (!ms.is_number() || !(ms.get<double>() >= 0))
      MOE_CONFIG_ERROR("{} {}: phases_ms \"{}\" must be a non-negative number", what, source, name);
    p.phase_ms[name] = ms.get<double>();
  }
  if (p.phase_ms.empty()) MOE_CONFIG_ERROR("{} {}: \"phases_ms\" is empty", what, source);
  return p;
}

ComputeProfile load_compute_profile(const std::string& path) {
  return parse_compute_profile(read_text(path, "compute profile"), path);
}

std::string all_to_all_bench_json(const std::vector<dist::AllToAllBenchResult>& results, const std::string& backend) {
  nlohmann::ordered_json j;
  j["format"] = "moe-a2a-bench-1";
  j["backend"] = backend;
  j["ranks"] = results.empty() ? 0 : results.front().ranks;
  j["nodes"] = results.empty() ? 0 : results.front().nodes;
  j["off_rank_bytes"] = results.empty() ? 0.0 : results.front().off_rank_bytes;
  j["results"] = nlohmann::ordered_json::array();
  for (const dist::AllToAllBenchResult& r : results)
    j["results"].push_back({{"kind", std::string(name_of(r.kind))},
                            {"dispatch_ms", r.dispatch_ms},
                            {"combine_ms", r.combine_ms},
                            {"dispatch_gb_s", r.dispatch_gb_per_s},
                            {"combine_gb_s", r.combine_gb_per_s}});
  return j.dump(2) + "\n";
}

std::string all_reduce_bench_json(const dist::AllReduceSweep& sweep, const std::string& backend) {
  nlohmann::ordered_json j;
  j["format"] = "moe-allreduce-bench-1";
  j["backend"] = backend;
  j["ranks"] = sweep.ranks;
  j["nodes"] = sweep.nodes;
  j["results"] = nlohmann::ordered_json::array();
  for (const dist::AllReduceBenchResult& r : sweep.results)
    j["results"].push_back({{"bytes", r.bytes},
                            {"ms", r.ms},
                            {"algbw_gb_s", r.alg_gb_per_s},
                            {"busbw_gb_s", r.bus_gb_per_s},
                            {"sums_ok", r.sums_ok}});
  return j.dump(2) + "\n";
}

namespace {

void read_all_to_all(const nlohmann::json& j, const std::string& what, const std::string& source,
                     MeasuredCollectives& m) {
  const double nodes = json_number(j, "nodes", what, source);
  if (nodes != 1) return;  // only an exchange inside one node stands for the NVLink rate
  double rate = 0;
  for (const nlohmann::json& r : j["results"])
    if (r.is_object() && r.value("kind", "") == "flat")
      rate = 0.5 * (json_number(r, "dispatch_gb_s", what, source) + json_number(r, "combine_gb_s", what, source)) * 1e9;
  if (rate <= 0) MOE_CONFIG_ERROR("{} {}: no \"flat\" result", what, source);
  m.intra_all_to_all_bytes_per_s = rate;
}

void read_all_reduce(const nlohmann::json& j, const std::string& what, const std::string& source,
                     MeasuredCollectives& m) {
  const double nodes = json_number(j, "nodes", what, source);
  if (json_number(j, "ranks", what, source) < 2)
    MOE_CONFIG_ERROR("{} {}: an all-reduce sweep over fewer than 2 ranks measures nothing", what, source);
  if (nodes != 1) return;  // the inter-node rate stays the hardware description's
  double smallest = 0, largest = 0, latency_ms = 0, busbw = 0;
  for (const nlohmann::json& r : j["results"]) {
    if (!r.is_object()) MOE_CONFIG_ERROR("{} {}: \"results\" must hold objects", what, source);
    if (!r.value("sums_ok", false)) MOE_CONFIG_ERROR("{} {}: a result with \"sums_ok\": false (wrong sums)", what, source);
    const double bytes = json_number(r, "bytes", what, source), ms = json_number(r, "ms", what, source);
    const double bw = json_number(r, "busbw_gb_s", what, source);
    if (bytes <= 0 || ms <= 0 || bw <= 0) MOE_CONFIG_ERROR("{} {}: \"bytes\", \"ms\" and \"busbw_gb_s\" must be positive", what, source);
    if (smallest == 0 || bytes < smallest) smallest = bytes, latency_ms = ms;
    if (bytes > largest) largest = bytes, busbw = bw;
  }
  if (largest == 0) MOE_CONFIG_ERROR("{} {}: no results", what, source);
  m.intra_all_reduce_bus_bytes_per_s = busbw * 1e9;
  m.intra_all_reduce_latency_us = latency_ms * 1e3;
}

}  // namespace

MeasuredCollectives parse_measured_collectives(const std::string& text, const std::string& source) {
  MeasuredCollectives m;
  const std::string what = "collectives";
  const nlohmann::json j = parse_json(text, what, source);
  const std::string format = j.is_object() ? j.value("format", "") : "";
  if (format != "moe-a2a-bench-1" && format != "moe-allreduce-bench-1")
    MOE_CONFIG_ERROR("{} {}: \"format\" must be \"moe-a2a-bench-1\" (moe a2a-bench --json) or "
                     "\"moe-allreduce-bench-1\" (moe allreduce-bench --json)",
                     what, source);
  if (!j.contains("results") || !j["results"].is_array())
    MOE_CONFIG_ERROR("{} {}: \"results\" must be an array", what, source);
  if (format == "moe-a2a-bench-1") read_all_to_all(j, what, source, m);
  else read_all_reduce(j, what, source, m);
  return m;
}

MeasuredCollectives load_measured_collectives(const std::vector<std::string>& paths) {
  MeasuredCollectives merged;
  for (const std::string& path : paths) {
    const MeasuredCollectives m = parse_measured_collectives(read_text(path, "collectives"), path);
    if (m.intra_all_to_all_bytes_per_s > 0) merged.intra_all_to_all_bytes_per_s = m.intra_all_to_all_bytes_per_s;
    if (m.intra_all_reduce_bus_bytes_per_s > 0) {
      merged.intra_all_reduce_bus_bytes_per_s = m.intra_all_reduce_bus_bytes_per_s;
      merged.intra_all_reduce_latency_us = m.intra_all_reduce_latency_us;
    }
  }
  return merged;
}

ExpertLoads parse_expert_loads(const std::string& jsonl, const std::string& source) {
  ExpertLoads loads;
  std::istringstream lines(jsonl);
  std::string line;
  for (int64_t number = 1; std::getline(lines, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      MOE_CONFIG_ERROR("expert loads {}: line {} is not JSON", source, number);
    }
    if (!record.is_object() || record.value("type", "") != "step" || !record.contains("layers")) continue;
    if (!record["layers"].is_array()) MOE_CONFIG_ERROR("expert loads {}: line {}: layers is not a list", source, number);
    for (const nlohmann::json& layer : record["layers"]) {
      if (!layer.is_object() || !layer.contains("tokens_per_expert") || !layer["tokens_per_expert"].is_array())
        MOE_CONFIG_ERROR("expert loads {}: line {}: a layer without tokens_per_expert", source, number);
      std::vector<int64_t> row;
      for (const nlohmann::json& count : layer["tokens_per_expert"]) {
        if (!count.is_number_integer() || count.get<int64_t>() < 0)
          MOE_CONFIG_ERROR("expert loads {}: line {}: tokens_per_expert holds {}, not a count", source, number,
                           count.dump());
        row.push_back(count.get<int64_t>());
      }
      if (loads.n_experts == 0) loads.n_experts = static_cast<int64_t>(row.size());
      if (static_cast<int64_t>(row.size()) != loads.n_experts || row.empty())
        MOE_CONFIG_ERROR("expert loads {}: line {}: {} experts where earlier lines have {}", source, number, row.size(),
                         loads.n_experts);
      loads.tokens_RE.push_back(std::move(row));
    }
  }
  if (loads.tokens_RE.empty())
    MOE_CONFIG_ERROR("expert loads {}: no step record with layers[].tokens_per_expert (a metrics.jsonl of an MoE run)",
                     source);
  return loads;
}

ExpertLoads load_expert_loads(const std::string& path) { return parse_expert_loads(read_text(path, "expert loads"), path); }

}  // namespace moe
