// Config loading: TOML file -> overrides -> validation, each error one line that names
// where the value came from (file:line:column or "command line") and the key.
#include "config/run_config.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <type_traits>

#include "core/error.h"
#include "config/config_rules.h"

namespace moe {
namespace {

constexpr std::array<std::string_view, 9> kSections = {
    "model", "moe", "training", "optimizer", "lr", "data", "metrics", "checkpoint", "parallel"};

// The single list of keys: parsing, overrides and config_to_toml all walk it, so a key
// cannot be readable but not writable. Calls visit(section, key, field) in file order.
template <class Config, class Visit>
void for_each_key(Config& c, Visit&& visit) {
  auto& m = c.model;
  visit("model", "vocab_size", m.vocab_size);
  visit("model", "dim", m.dim);
  visit("model", "n_layers", m.n_layers);
  visit("model", "n_heads", m.n_heads);
  visit("model", "n_kv_heads", m.n_kv_heads);
  visit("model", "seq_len", m.seq_len);
  visit("model", "first_dense_layers", m.first_dense_layers);
  visit("model", "dense_hidden", m.dense_hidden);
  visit("model", "rope_theta", m.rope_theta);
  visit("model", "norm_eps", m.norm_eps);
  visit("model", "tie_embeddings", m.tie_embeddings);
  visit("model", "init_std", m.init_std);
  auto& e = c.model.moe;
  visit("moe", "n_experts", e.n_experts);
  visit("moe", "top_k", e.top_k);
  visit("moe", "expert_hidden", e.expert_hidden);
  visit("moe", "n_shared_experts", e.n_shared_experts);
  visit("moe", "score_func", e.score_func);
  visit("moe", "temperature", e.temperature);
  visit("moe", "renormalize", e.renormalize);
  visit("moe", "router_bias", e.router_bias);
  visit("moe", "capacity_factor", e.capacity_factor);
  visit("moe", "aux_loss_coef", e.aux_loss_coef);
  visit("moe", "z_loss_coef", e.z_loss_coef);
  visit("moe", "bias_balancing", e.bias_balancing);
  visit("moe", "bias_update_rate", e.bias_update_rate);
  visit("moe", "temperature_control", e.temperature_control);
  visit("moe", "temperature_min", e.temperature_min);
  visit("moe", "temperature_max", e.temperature_max);
  visit("moe", "temperature_gain", e.temperature_gain);
  visit("moe", "route_groups", e.route_groups);
  visit("moe", "route_top_groups", e.route_top_groups);
  visit("moe", "route_cache", e.route_cache);
  visit("moe", "speculative_dispatch", e.speculative_dispatch);
  visit("moe", "route_cache_predict", e.route_cache_predict);
  visit("moe", "route_cache_keys", e.route_cache_keys);
  visit("moe", "merge_interval", e.merge_interval);
  visit("moe", "merge_similarity", e.merge_similarity);
  visit("moe", "merge_pairs", e.merge_pairs);
  visit("moe", "merge_noise", e.merge_noise);
  auto& t = c.training;
  visit("training", "steps", t.steps);
  visit("training", "global_batch_tokens", t.global_batch_tokens);
  visit("training", "micro_batch", t.micro_batch);
  visit("training", "seed", t.seed);
  visit("training", "threads", t.threads);
  visit("training", "device", t.device);
  visit("training", "grad_clip", t.grad_clip);
  visit("training", "expert_grad_clip", t.expert_grad_clip);
  visit("training", "val_interval", t.val_interval);
  visit("training", "val_batches", t.val_batches);
  visit("training", "stop_at", t.stop_at);
  visit("training", "nan_max_skips", t.nan_max_skips);
  visit("training", "nan_lr_factor", t.nan_lr_factor);
  visit("training", "loss_spike_factor", t.loss_spike_factor);
  visit("training", "memory_limit_mb", t.memory_limit_mb);
  visit("training", "recompute_layers", t.recompute_layers);
  visit("training", "recompute_experts", t.recompute_experts);
  visit("training", "recompute_experts_layers", t.recompute_experts_layers);
  visit("training", "cuda_graphs", t.cuda_graphs);
  visit("training", "deterministic", t.deterministic);
  visit("training", "deterministic_attention", t.deterministic_attention);
  visit("training", "attention_query_chunks", t.attention_query_chunks);
  visit("training", "expert_grad_dtype", t.expert_grad_dtype);
  visit("training", "precision", t.precision);
  visit("training", "fp8_weight_cache", t.fp8_weight_cache);
  visit("training", "fp8_weight_gradients", t.fp8_weight_gradients);
  visit("training", "fp8_weight_gradient_scales", t.fp8_weight_gradient_scales);
  visit("training", "fp8_gemm_backend", t.fp8_gemm_backend);
  visit("training", "bf16_gemm_backend", t.bf16_gemm_backend);
  visit("training", "interleave_gate_up", t.interleave_gate_up);
  visit("training", "swiglu_in_gemm", t.swiglu_in_gemm);
  visit("optimizer", "beta1", c.optimizer.beta1);
  visit("optimizer", "beta2", c.optimizer.beta2);
  visit("optimizer", "eps", c.optimizer.eps);
  visit("optimizer", "weight_decay", c.optimizer.weight_decay);
  visit("optimizer", "state_dtype", c.optimizer.state_dtype);
  visit("lr", "peak", c.lr.peak);
  visit("lr", "warmup_steps", c.lr.warmup_steps);
  visit("lr", "min_ratio", c.lr.min_ratio);
  visit("data", "dir", c.data.dir);
  visit("data", "extension", c.data.extension);
  visit("data", "tokenizer", c.data.tokenizer);
  visit("data", "val_fraction", c.data.val_fraction);
  visit("data", "max_bytes", c.data.max_bytes);
  visit("data", "shards", c.data.shards);
  visit("data", "text_field", c.data.text_field);
  visit("data", "sources", c.data.sources);
  visit("metrics", "log_interval", c.metrics.log_interval);
  visit("metrics", "dir", c.metrics.dir);
  visit("metrics", "tensorboard", c.metrics.tensorboard);
  visit("metrics", "peak_tflops", c.metrics.peak_tflops);
  visit("metrics", "alert_imbalance", c.metrics.alert_imbalance);
  visit("metrics", "alert_comm_wait", c.metrics.alert_comm_wait);
  visit("metrics", "alert_grad_sync_ms", c.metrics.alert_grad_sync_ms);
  visit("metrics", "phase_times", c.metrics.phase_times);
  visit("metrics", "trace", c.metrics.trace);
  visit("checkpoint", "dir", c.checkpoint.dir);
  visit("checkpoint", "interval", c.checkpoint.interval);
  visit("checkpoint", "keep_last", c.checkpoint.keep_last);
  visit("checkpoint", "async", c.checkpoint.async);
  visit("parallel", "expert_parallel", c.parallel.expert_parallel);
  visit("parallel", "all_to_all", c.parallel.all_to_all);
  visit("parallel", "bucket_mb", c.parallel.bucket_mb);
  visit("parallel", "a2a_chunks", c.parallel.a2a_chunks);
  visit("parallel", "a2a_compression", c.parallel.a2a_compression);
  visit("parallel", "comm_sms", c.parallel.comm_sms);
  visit("parallel", "zero", c.parallel.zero);
  visit("parallel", "grad_reduce_dtype", c.parallel.grad_reduce_dtype);
  visit("parallel", "rebalance_interval", c.parallel.rebalance_interval);
  visit("parallel", "rebalance_max_experts", c.parallel.rebalance_max_experts);
  visit("parallel", "split_experts", c.parallel.split_experts);
  visit("parallel", "backend", c.parallel.backend);
}

// Strings and enums are written as TOML strings (and may be given bare on the command line).
template <class T>
constexpr bool kStringTyped = std::is_same_v<T, std::string> || std::is_enum_v<T>;

std::string join(const auto& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + std::string(item);
  return out;
}

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

std::vector<std::string> keys_in(std::string_view section) {
  std::vector<std::string> keys;
  RunConfig defaults;
  for_each_key(defaults, [&](std::string_view s, std::string_view k, auto&) {
    if (s == section) keys.emplace_back(k);
  });
  return keys;
}

std::string unknown_key_message(std::string_view section, std::string_view key) {
  if (section == "parallel" && key == "shard_optimizer")
    return "parallel.shard_optimizer was replaced by parallel.zero (true: zero = 1, false: zero = 0)";
  return fmt::format("unknown key '{}.{}' (known keys in [{}]: {})", section, key, section,
                     join(keys_in(section)));
}

std::string unknown_section_message(std::string_view section) {
  return fmt::format("unknown section [{}] (known sections: {})", section, join(kSections));
}

// "a, b, c": an enum's names, for messages.
template <class E>
std::string names_of() {
  std::string out;
  for (const auto& entry : enum_names(E{})) out += (out.empty() ? "" : ", ") + std::string(entry.name);
  return out;
}


// A value as the user wrote it, with its TOML type, for "got ..." in messages.
std::string describe(const toml::node& node) {
  if (node.is_table()) return "a table";
  if (node.is_array()) return "an array";
  if (auto v = node.as_string()) return "string " + toml_string(v->get());
  std::ostringstream os;
  node.visit([&](const auto& v) { os << v; });
  const char* type = node.is_integer()          ? "integer "
                     : node.is_floating_point() ? "float "
                     : node.is_boolean()        ? "boolean "
                                                : "date/time ";
  return type + one_line(os.str());
}

// Thrown while converting one value; the caller prefixes where the value came from.
struct ValueError {
  std::string message;
};

template <class T>
void assign(T& field, const toml::node& node, const std::string& key) {
  if constexpr (std::is_same_v<T, int64_t>) {
    if (auto v = node.as_integer()) return void(field = v->get());
    throw ValueError{fmt::format("{} must be an integer, got {}", key, describe(node))};
  } else if constexpr (std::is_same_v<T, uint64_t>) {
    if (auto v = node.as_integer(); v && v->get() >= 0) return void(field = static_cast<uint64_t>(v->get()));
    throw ValueError{fmt::format("{} must be a non-negative integer, got {}", key, describe(node))};
  } else if constexpr (std::is_same_v<T, double>) {
    if (auto v = node.as_floating_point()) return void(field = v->get());
    if (auto v = node.as_integer()) return void(field = static_cast<double>(v->get()));
    throw ValueError{fmt::format("{} must be a number, got {}", key, describe(node))};
  } else if constexpr (std::is_same_v<T, bool>) {
    if (auto v = node.as_boolean()) return void(field = v->get());
    throw ValueError{fmt::format("{} must be true or false, got {}", key, describe(node))};
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (auto v = node.as_string()) return void(field = v->get());
    throw ValueError{fmt::format("{} must be a string, got {}", key, describe(node))};
  } else if constexpr (std::is_enum_v<T>) {
    if (auto v = node.as_string(); v && parse_enum(v->get(), field)) return;
    throw ValueError{fmt::format("{} must be one of {}, got {}", key, names_of<T>(), describe(node))};
  } else {
    static_assert(sizeof(T) == 0, "config field of an unsupported type");
  }
}


// Builds a RunConfig from one file and the overrides, remembering where every key was set.
class ConfigReader {
 public:
  explicit ConfigReader(std::string source) : source_(std::move(source)) {}

  void read_toml(const std::string& text) {
    toml::table root;
    try {
      root = toml::parse(text, std::string_view(source_));
    } catch (const toml::parse_error& e) {
      MOE_CONFIG_ERROR("{}: TOML syntax error: {}", where(e.source()), one_line(std::string(e.description())));
    }
    // Report the first problem in file order (tables iterate alphabetically).
    std::vector<std::pair<std::pair<uint32_t, uint32_t>, std::string>> errors;
    auto record = [&](const toml::source_region& at, const std::string& message) {
      errors.push_back({{at.begin.line, at.begin.column}, where(at) + ": " + message});
    };
    for (const auto& [section_key, section_node] : root) {
      std::string_view section = section_key.str();
      if (std::find(kSections.begin(), kSections.end(), section) == kSections.end()) {
        record(section_key.source(),
               section_node.is_table() ? unknown_section_message(section)
                                       : fmt::format("key '{}' is outside any section (sections: {})", section,
                                                     join(kSections)));
        continue;
      }
      const toml::table* table = section_node.as_table();
      if (!table) {
        record(section_node.source(), fmt::format("'{}' must be a section [{}], got {}", section, section,
                                                  describe(section_node)));
        continue;
      }
      for (const auto& [key, node] : *table) {
        try {
          if (!set(section, key.str(), node, where(node.source())))
            record(key.source(), unknown_key_message(section, key.str()));
        } catch (const ValueError& e) {
          record(node.source(), e.message);
        }
      }
    }
    if (!errors.empty()) throw ConfigError(std::min_element(errors.begin(), errors.end())->second);
  }

  // "section.key=value" (a leading "--" is allowed, as typed on the command line).
  void apply_override(std::string_view text) {
    const std::string original(text);
    if (text.starts_with("--")) text.remove_prefix(2);
    size_t eq = text.find('=');
    size_t dot = text.substr(0, eq).find('.');
    if (eq == std::string_view::npos || dot == std::string_view::npos)
      MOE_CONFIG_ERROR("command line: override '{}' must look like section.key=value", original);
    std::string section(text.substr(0, dot));
    std::string key(text.substr(dot + 1, eq - dot - 1));
    std::string value(text.substr(eq + 1));
    if (std::find(kSections.begin(), kSections.end(), section) == kSections.end())
      MOE_CONFIG_ERROR("command line: {} in '{}'", unknown_section_message(section), original);

    bool known = false, string_typed = false;
    RunConfig probe;
    for_each_key(probe, [&](std::string_view s, std::string_view k, auto& field) {
      if (s != section || k != key) return;
      known = true;
      string_typed = kStringTyped<std::remove_cvref_t<decltype(field)>>;
    });
    if (!known) MOE_CONFIG_ERROR("command line: {}", unknown_key_message(section, key));

    std::optional<toml::table> parsed;
    try {
      parsed = toml::parse("v = " + value, std::string_view("command line"));
    } catch (const toml::parse_error&) {
    }
    const toml::node* node = parsed && parsed->size() == 1 ? parsed->get("v") : nullptr;
    // Strings may be given bare (--data.dir=/tmp/x). For other keys a value that is not
    // TOML is passed on as a string too, so the error says "must be an integer, got ...".
    toml::value<std::string> bare(value);
    if (!node || (string_typed && !node->is_string())) node = &bare;
    try {
      set(section, key, *node, "command line");
    } catch (const ValueError& e) {
      MOE_CONFIG_ERROR("command line: {}", e.message);
    }
  }

  void validate() const {
    try {
      check_run_config(config_);
    } catch (const RuleBroken& issue) {
      // Blame the command line if it set any key involved, else the file line of the first
      // key the file set, else the file as a whole (the rule broke on defaults).
      std::string origin = source_;
      for (const auto& key : issue.keys) {
        auto it = origin_.find(key);
        if (it != origin_.end() && it->second == "command line") {
          origin = it->second;
          break;
        }
        if (it != origin_.end() && origin == source_) origin = it->second;
      }
      throw ConfigError(origin + ": " + issue.message);
    }
  }

  const RunConfig& config() const { return config_; }

 private:
  std::string where(const toml::source_region& at) const {
    if (at.begin.line == 0) return source_;
    return fmt::format("{}:{}:{}", source_, at.begin.line, at.begin.column);
  }

  // Assigns `node` to section.key; false if no such key. Throws ValueError on a bad type.
  bool set(std::string_view section, std::string_view key, const toml::node& node, const std::string& origin) {
    bool found = false;
    for_each_key(config_, [&](std::string_view s, std::string_view k, auto& field) {
      if (s != section || k != key) return;
      found = true;
      std::string full = fmt::format("{}.{}", s, k);
      assign(field, node, full);
      origin_[full] = origin;
    });
    return found;
  }

  std::string source_;
  RunConfig config_;
  std::map<std::string, std::string> origin_;  // "section.key" -> "file:line:col" or "command line"
};

template <class T>
std::string toml_value(const T& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    return toml_string(v);
  } else if constexpr (std::is_enum_v<T>) {
    return toml_string(name_of(v));
  } else if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_same_v<T, double>) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    std::string s = fmt::format("{}", v);  // shortest text that reads back to the same double
    if (s.find_first_of(".e") == std::string::npos) s += ".0";
    return s;
  } else {
    return fmt::format("{}", v);
  }
}

}  // namespace

TokenizerSpec parse_tokenizer_spec(std::string_view spec) {
  if (spec == "byte") return {TokenizerKind::Byte, 0};
  if (spec.starts_with("tiktoken:")) {
    const std::string_view rest = spec.substr(9);
    const size_t colon = rest.find(':');
    return {TokenizerKind::Tiktoken, 0, colon == std::string_view::npos ? "" : std::string(rest.substr(colon + 1))};
  }
  if (spec.starts_with("hf:") && spec.size() > 3) return {TokenizerKind::HfJson, 0, std::string(spec.substr(3))};
  if (spec.starts_with("sentencepiece:") && spec.size() > 14)
    return {TokenizerKind::SentencePiece, 0, std::string(spec.substr(14))};
  if (spec.starts_with("bpe:")) {
    const std::string_view n = spec.substr(4);
    if (n.empty() || n.size() >= 10 || n.find_first_not_of("0123456789") != std::string_view::npos) return {};
    const int64_t vocab = std::stoll(std::string(n));
    if (vocab < kByteVocabSize + 1 || vocab > 1'000'000) return {};
    return {TokenizerKind::TrainBpe, vocab};
  }
  if (spec.ends_with(".json")) return {TokenizerKind::HfJson, 0, std::string(spec)};
  if (spec.ends_with(".model")) return {TokenizerKind::SentencePiece, 0, std::string(spec)};
  return {};
}

std::vector<DataSourceSpec> parse_data_sources(std::string_view text, std::string* error) {
  constexpr size_t kMaxSources = 256;
  std::vector<DataSourceSpec> sources;
  auto refuse = [&](std::string message) {
    if (error) *error = std::move(message);
    return std::vector<DataSourceSpec>{};
  };
  if (text.ends_with(',')) return refuse("the last entry is empty");
  while (!text.empty()) {
    const size_t comma = text.find(',');
    std::string_view entry = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    while (!entry.empty() && entry.front() == ' ') entry.remove_prefix(1);
    while (!entry.empty() && entry.back() == ' ') entry.remove_suffix(1);
    if (entry.empty()) return refuse(fmt::format("entry {} is empty", sources.size() + 1));
    DataSourceSpec source;
    source.path = std::string(entry);
    // The text before the first ':' is the weight when it is written like a number.
    if (const size_t colon = entry.find(':'); colon != std::string_view::npos) {
      const std::string weight(entry.substr(0, colon));
      if (weight.find_first_of("0123456789") != std::string::npos &&
          weight.find_first_not_of("0123456789.eE+-") == std::string::npos) {
        size_t used = 0;
        double value = 0;
        try {
          value = std::stod(weight, &used);
        } catch (const std::exception&) {
          used = 0;  // out of range
        }
        if (used != weight.size() || !(value > 0) || !std::isfinite(value))
          return refuse(fmt::format("the weight of '{}' must be a number > 0", entry));
        source.weight = value;
        source.path = std::string(entry.substr(colon + 1));
      }
    }
    while (!source.path.empty() && source.path.front() == ' ') source.path.erase(0, 1);
    if (source.path.empty()) return refuse(fmt::format("entry '{}' has no path", entry));
    sources.push_back(std::move(source));
    if (sources.size() > kMaxSources) return refuse(fmt::format("more than {} entries", kMaxSources));
  }
  if (sources.empty()) return refuse("no entry");
  return sources;
}

RunConfig parse_config(const std::string& toml_text, const std::string& source_name,
                       const std::vector<std::string>& overrides) {
  ConfigReader reader(source_name);
  reader.read_toml(toml_text);
  for (const auto& text : overrides) reader.apply_override(text);
  reader.validate();
  return reader.config();
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) MOE_CONFIG_ERROR("{}: config file does not exist", path);
  if (std::filesystem::is_directory(path, ec)) MOE_CONFIG_ERROR("{}: is a directory, expected a TOML file", path);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) MOE_CONFIG_ERROR("{}: cannot read config file", path);
  return parse_config(text.str(), path, overrides);
}

void validate_config(const RunConfig& config) {
  try {
    check_run_config(config);
  } catch (const RuleBroken& issue) {
    throw ConfigError(issue.message);
  }
}

std::string config_to_toml(const RunConfig& config) {
  std::string out = "# moe-train run config; every key is described in docs/CONFIG.md\n";
  std::string_view current;
  for_each_key(config, [&](std::string_view section, std::string_view key, const auto& field) {
    if (section != current) out += fmt::format("\n[{}]\n", current = section);
    out += fmt::format("{} = {}\n", key, toml_value(field));
  });
  return out;
}

}  // namespace moe
