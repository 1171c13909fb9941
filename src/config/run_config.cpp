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
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <type_traits>

#include "core/error.h"
#include "core/threads.h"

namespace moe {
namespace {

// training.fp8_gemm_backend = deepgemm: cuda::PaddedExpertGemmFp8's compiled group counts.
constexpr int64_t kDeepGemmMaxExperts = 256;
// training.fp8_gemm_backend = auto: DeepGEMM's only while its padding rows are at most this
// share of a micro-batch's routed rows (measured wins at 1.6% and 12.5%, BENCHMARKS.md).
constexpr double kDeepGemmMaxPadding = 0.15;

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
  visit("training", "expert_grad_dtype", t.expert_grad_dtype);
  visit("training", "precision", t.precision);
  visit("training", "fp8_weight_cache", t.fp8_weight_cache);
  visit("training", "fp8_weight_gradients", t.fp8_weight_gradients);
  visit("training", "fp8_weight_gradient_scales", t.fp8_weight_gradient_scales);
  visit("training", "fp8_gemm_backend", t.fp8_gemm_backend);
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

// A TOML basic string: quotes, backslashes and control characters escaped.
std::string toml_string(std::string_view s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') out += fmt::format("\\{}", static_cast<char>(ch));
    else if (ch < 0x20 || ch == 0x7f) out += fmt::format("\\u{:04X}", ch);
    else out += static_cast<char>(ch);
  }
  return out + "\"";
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

// A rule that failed: the keys involved (to find where they were set) and the message.
struct Issue {
  std::vector<std::string> keys;
  std::string message;
};

[[noreturn]] void fail(std::vector<std::string> keys, std::string message) {
  throw Issue{std::move(keys), std::move(message)};
}

void check_int(const char* key, int64_t v, int64_t lo, const char* what) {
  if (v < lo) fail({key}, fmt::format("{} must be {}, got {}", key, what, v));
}
void positive(const char* key, int64_t v) { check_int(key, v, 1, "a positive integer"); }
void non_negative(const char* key, int64_t v) { check_int(key, v, 0, "an integer >= 0"); }
// Shapes beyond these are typos (n_layers = 1000000), not models: refused before anything
// is built from them. `lo` is 0 or 1.
void in_range(const char* key, int64_t v, int64_t lo, int64_t hi) {
  if (lo == 1) positive(key, v);
  else non_negative(key, v);
  if (v > hi) fail({key}, fmt::format("{} must be at most {}, got {}", key, hi, v));
}
constexpr int64_t kMaxDim = 65536, kMaxLayers = 1024, kMaxHeads = 1024, kMaxSeqLen = int64_t{1} << 20,
                  kMaxHidden = int64_t{1} << 20, kMaxExperts = 65536, kMaxSharedExperts = 1024;

// Real-valued rules are written so that NaN fails them too.
void check_real(const char* key, double v, bool ok, const char* what) {
  if (!ok || !std::isfinite(v)) fail({key}, fmt::format("{} must be {}, got {}", key, what, v));
}
void positive_real(const char* key, double v) { check_real(key, v, v > 0, "a number > 0"); }
void non_negative_real(const char* key, double v) { check_real(key, v, v >= 0, "a number >= 0"); }

void check_model(const ModelConfig& m) {
  non_negative("model.vocab_size", m.vocab_size);
  if (m.vocab_size > std::numeric_limits<int32_t>::max())
    fail({"model.vocab_size"}, fmt::format("model.vocab_size must fit token ids in int32, got {}", m.vocab_size));
  in_range("model.dim", m.dim, 1, kMaxDim);
  in_range("model.n_layers", m.n_layers, 1, kMaxLayers);
  in_range("model.n_heads", m.n_heads, 1, kMaxHeads);
  in_range("model.n_kv_heads", m.n_kv_heads, 1, kMaxHeads);
  in_range("model.seq_len", m.seq_len, 1, kMaxSeqLen);
  if (m.dim % m.n_heads != 0)
    fail({"model.dim", "model.n_heads"},
         fmt::format("model.dim ({}) must be divisible by model.n_heads ({})", m.dim, m.n_heads));
  if (m.head_dim() % 2 != 0)
    fail({"model.dim", "model.n_heads"},
         fmt::format("model.dim / model.n_heads (the head dimension, {}) must be even for rotary embeddings",
                     m.head_dim()));
  if (m.n_heads % m.n_kv_heads != 0)
    fail({"model.n_heads", "model.n_kv_heads"},
         fmt::format("model.n_heads ({}) must be a multiple of model.n_kv_heads ({})", m.n_heads, m.n_kv_heads));
  if (m.first_dense_layers < 0 || m.first_dense_layers > m.n_layers)
    fail({"model.first_dense_layers", "model.n_layers"},
         fmt::format("model.first_dense_layers must be between 0 and model.n_layers ({}), got {}",
                     m.n_layers, m.first_dense_layers));
  in_range("model.dense_hidden", m.dense_hidden, 1, kMaxHidden);
  positive_real("model.rope_theta", m.rope_theta);
  positive_real("model.norm_eps", m.norm_eps);
  positive_real("model.init_std", m.init_std);

  const MoEConfig& e = m.moe;
  in_range("moe.n_experts", e.n_experts, 1, kMaxExperts);
  if (e.top_k < 1 || e.top_k > e.n_experts)
    fail({"moe.top_k", "moe.n_experts"},
         fmt::format("moe.top_k must be between 1 and moe.n_experts ({}), got {}", e.n_experts, e.top_k));
  in_range("moe.expert_hidden", e.expert_hidden, 1, kMaxHidden);
  in_range("moe.n_shared_experts", e.n_shared_experts, 0, kMaxSharedExperts);
  positive_real("moe.temperature", e.temperature);
  non_negative_real("moe.capacity_factor", e.capacity_factor);
  non_negative_real("moe.aux_loss_coef", e.aux_loss_coef);
  non_negative_real("moe.z_loss_coef", e.z_loss_coef);
  non_negative_real("moe.bias_update_rate", e.bias_update_rate);
  non_negative("moe.route_groups", e.route_groups);
  positive_real("moe.temperature_min", e.temperature_min);
  positive_real("moe.temperature_max", e.temperature_max);
  positive_real("moe.temperature_gain", e.temperature_gain);
  if (e.temperature_min > e.temperature_max)
    fail({"moe.temperature_min", "moe.temperature_max"},
         fmt::format("moe.temperature_min ({}) must be <= moe.temperature_max ({})", e.temperature_min,
                     e.temperature_max));
  if (e.temperature_control && e.aux_loss_coef == 0 && !e.bias_balancing)
    fail({"moe.temperature_control", "moe.aux_loss_coef", "moe.bias_balancing"},
         "moe.temperature_control steers the balancing terms: it needs moe.aux_loss_coef > 0 or moe.bias_balancing");
  if (e.temperature_control && (e.temperature < e.temperature_min || e.temperature > e.temperature_max))
    fail({"moe.temperature", "moe.temperature_min", "moe.temperature_max"},
         fmt::format("moe.temperature ({}) must be within [moe.temperature_min, moe.temperature_max] = [{}, {}] "
                     "with moe.temperature_control on", e.temperature, e.temperature_min, e.temperature_max));
  non_negative("moe.merge_interval", e.merge_interval);
  check_real("moe.merge_similarity", e.merge_similarity, e.merge_similarity >= -1 && e.merge_similarity <= 1,
             "a number between -1 and 1");
  check_real("moe.merge_noise", e.merge_noise, e.merge_noise >= 0 && e.merge_noise < 1, "a number in [0, 1)");
  positive("moe.merge_pairs", e.merge_pairs);
  // Each merged pair needs a third expert (outside every pair) to split.
  if (e.merge_interval > 0 && 3 * e.merge_pairs > e.n_experts)
    fail({"moe.merge_pairs", "moe.n_experts"},
         fmt::format("moe.merge_pairs ({}) needs moe.n_experts >= 3 x moe.merge_pairs, got {}", e.merge_pairs,
                     e.n_experts));
  if (e.route_groups > 1) {
    if (e.n_experts % e.route_groups != 0)
      fail({"moe.route_groups", "moe.n_experts"},
           fmt::format("moe.route_groups ({}) must divide moe.n_experts ({})", e.route_groups, e.n_experts));
    else if (e.route_top_groups < 1 || e.route_top_groups > e.route_groups ||
             e.top_k > e.route_top_groups * (e.n_experts / e.route_groups))
      fail({"moe.route_top_groups", "moe.route_groups", "moe.top_k"},
           fmt::format("moe.route_top_groups must be between 1 and moe.route_groups ({}) and its groups must hold "
                       "moe.top_k ({}) experts, got {}",
                       e.route_groups, e.top_k, e.route_top_groups));
  }
  if (e.route_cache_predict != 0 && (e.route_cache_predict < e.top_k || e.route_cache_predict > e.n_experts))
    fail({"moe.route_cache_predict", "moe.top_k", "moe.n_experts"},
         fmt::format("moe.route_cache_predict must be 0 (top_k) or between moe.top_k ({}) and moe.n_experts ({}), got {}",
                     e.top_k, e.n_experts, e.route_cache_predict));
  non_negative("moe.route_cache_keys", e.route_cache_keys);
}

void check_training(const RunConfig& c) {
  const TrainingConfig& t = c.training;
  positive("training.steps", t.steps);
  positive("training.micro_batch", t.micro_batch);
  int64_t per_micro = 0;
  if (__builtin_mul_overflow(t.micro_batch, c.model.seq_len, &per_micro))
    fail({"training.micro_batch", "model.seq_len"}, "training.micro_batch * model.seq_len overflows int64");
  if (t.global_batch_tokens <= 0 || t.global_batch_tokens % per_micro != 0) {
    // Name the valid neighbours so the fix is one edit.
    int64_t below = t.global_batch_tokens / per_micro * per_micro;
    std::string nearest = below >= per_micro ? fmt::format("{}, {}", below, below + per_micro)
                                             : fmt::format("{}", per_micro);
    fail({"training.global_batch_tokens", "training.micro_batch", "model.seq_len"},
         fmt::format("training.global_batch_tokens must be a positive multiple of training.micro_batch * "
                     "model.seq_len = {} * {} = {}, got {} (nearest valid: {})",
                     t.micro_batch, c.model.seq_len, per_micro, t.global_batch_tokens, nearest));
  }
  // TOML integers are signed 64-bit; a larger seed could not be written back.
  if (t.seed > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    fail({"training.seed"}, fmt::format("training.seed must be at most 2^63-1, got {}", t.seed));
  if (t.threads < 0 || t.threads > kMaxThreads)
    fail({"training.threads"}, fmt::format("training.threads must be between 0 (all cores) and {}, got {}",
                                           kMaxThreads, t.threads));
  non_negative_real("training.grad_clip", t.grad_clip);
  non_negative_real("training.expert_grad_clip", t.expert_grad_clip);
  non_negative("training.val_interval", t.val_interval);
  positive("training.val_batches", t.val_batches);
  if (t.stop_at < 0 || t.stop_at > t.steps)
    fail({"training.stop_at", "training.steps"},
         fmt::format("training.stop_at must be between 0 and training.steps ({}), got {}", t.steps, t.stop_at));
  non_negative("training.nan_max_skips", t.nan_max_skips);
  check_real("training.nan_lr_factor", t.nan_lr_factor, t.nan_lr_factor > 0 && t.nan_lr_factor <= 1, "in (0, 1]");
  check_real("training.loss_spike_factor", t.loss_spike_factor, t.loss_spike_factor == 0 || t.loss_spike_factor > 1,
             "0 (off) or a number > 1");
  non_negative("training.memory_limit_mb", t.memory_limit_mb);
  if (t.recompute_layers < -1)
    fail({"training.recompute_layers"},
         fmt::format("training.recompute_layers must be -1 (all layers), 0 (none) or a layer count, got {}",
                     t.recompute_layers));
  if (t.recompute_experts_layers < -1)
    fail({"training.recompute_experts_layers"},
         fmt::format("training.recompute_experts_layers must be -1 (all MoE layers) or a count of MoE layers, got {}",
                     t.recompute_experts_layers));
  if (t.precision == TrainingPrecision::Fp8) {
    if (t.device == TrainingDevice::Cpu)
      fail({"training.precision", "training.device"},
           "training.precision = fp8 runs on the GPU only: set training.device = cuda (or auto) or precision = bf16");
    if (c.model.dim % 128 != 0 || c.model.moe.expert_hidden % 128 != 0)
      fail({"training.precision", "model.dim", "moe.expert_hidden"},
           fmt::format("training.precision = fp8 needs model.dim ({}) and moe.expert_hidden ({}) to be multiples of "
                       "128 (the fp8 scale blocks)",
                       c.model.dim, c.model.moe.expert_hidden));
  } else if (!t.fp8_weight_cache) {
    fail({"training.fp8_weight_cache", "training.precision"},
         "training.fp8_weight_cache = false applies to training.precision = fp8 only");
  } else if (t.fp8_weight_gradients) {
    fail({"training.fp8_weight_gradients", "training.precision"},
         "training.fp8_weight_gradients = true applies to training.precision = fp8 only");
  }
  if (t.fp8_weight_gradient_scales != Fp8ColumnScales::Tile1x128 && !t.fp8_weight_gradients)
    fail({"training.fp8_weight_gradient_scales", "training.fp8_weight_gradients"},
         "training.fp8_weight_gradient_scales = 128x128 applies to training.fp8_weight_gradients = true only");
  if (t.fp8_gemm_backend == Fp8GemmBackend::DeepGemm) {
    if (t.precision != TrainingPrecision::Fp8)
      fail({"training.fp8_gemm_backend", "training.precision"},
           "training.fp8_gemm_backend = deepgemm applies to training.precision = fp8 only");
    if (c.parallel.expert_parallel > 1)
      fail({"training.fp8_gemm_backend", "parallel.expert_parallel"},
           "training.fp8_gemm_backend = deepgemm pads the rows of a local dispatch: not with parallel.expert_parallel > 1");
    if (c.parallel.comm_sms > 0)
      fail({"training.fp8_gemm_backend", "parallel.comm_sms"},
           "training.fp8_gemm_backend = deepgemm runs on every multiprocessor: set parallel.comm_sms = 0");
    if (c.model.moe.n_experts > kDeepGemmMaxExperts)
      fail({"training.fp8_gemm_backend", "moe.n_experts"},
           fmt::format("training.fp8_gemm_backend = deepgemm runs up to {} experts, not {}", kDeepGemmMaxExperts,
                       c.model.moe.n_experts));
  }

  const OptimizerConfig& o = c.optimizer;
  check_real("optimizer.beta1", o.beta1, o.beta1 >= 0 && o.beta1 < 1, "in [0, 1)");
  check_real("optimizer.beta2", o.beta2, o.beta2 >= 0 && o.beta2 < 1, "in [0, 1)");
  positive_real("optimizer.eps", o.eps);
  non_negative_real("optimizer.weight_decay", o.weight_decay);

  positive_real("lr.peak", c.lr.peak);
  non_negative("lr.warmup_steps", c.lr.warmup_steps);
  check_real("lr.min_ratio", c.lr.min_ratio, c.lr.min_ratio >= 0 && c.lr.min_ratio <= 1, "in [0, 1]");
}

void check_io(const RunConfig& c) {
  const DataConfig& d = c.data;
  if (d.dir.empty()) fail({"data.dir"}, "data.dir must name a directory, got \"\"");
  const TokenizerSpec tokenizer = parse_tokenizer_spec(d.tokenizer);
  if (tokenizer.kind == TokenizerKind::Invalid)
    fail({"data.tokenizer"}, fmt::format("data.tokenizer must be byte, bpe:<vocab size 258..1000000>, a path to a "
                                         "tokenizer.json (or hf:<path>), tiktoken:<gpt2|llama3|qwen2>:<rank file>, "
                                         "sentencepiece:<path> or a path to a .model file, got {}",
                                         toml_string(d.tokenizer)));
  check_real("data.val_fraction", d.val_fraction, d.val_fraction > 0 && d.val_fraction < 1, "in (0, 1)");
  non_negative("data.max_bytes", d.max_bytes);
  if (d.text_field.empty()) fail({"data.text_field"}, "data.text_field must name a JSON field, got \"\"");
  if (!d.sources.empty()) {
    std::string error;
    const std::vector<DataSourceSpec> sources = parse_data_sources(d.sources, &error);
    if (sources.empty())
      fail({"data.sources"}, fmt::format("data.sources must be comma-separated WEIGHT:PATH entries (e.g. "
                                         "\"0.7:/data/web,0.3:/data/code\"): {}, got {}",
                                         error, toml_string(d.sources)));
    if (!d.shards.empty())
      fail({"data.sources", "data.shards"}, "data.sources and data.shards exclude each other: a folder of "
                                            "shards can be one of the sources");
  }
  if (tokenizer.kind == TokenizerKind::Byte && c.model.vocab_size != 0 && c.model.vocab_size < kByteVocabSize)
    fail({"model.vocab_size", "data.tokenizer"},
         fmt::format("model.vocab_size ({}) is smaller than the byte tokenizer's {} ids (0 takes it from the "
                     "tokenizer)", c.model.vocab_size, kByteVocabSize));
  positive("metrics.log_interval", c.metrics.log_interval);
  positive_real("metrics.peak_tflops", c.metrics.peak_tflops);
  non_negative_real("metrics.alert_imbalance", c.metrics.alert_imbalance);
  non_negative_real("metrics.alert_comm_wait", c.metrics.alert_comm_wait);
  non_negative_real("metrics.alert_grad_sync_ms", c.metrics.alert_grad_sync_ms);
  if (c.metrics.trace && c.metrics.dir.empty())
    fail({"metrics.trace", "metrics.dir"}, "metrics.trace = true writes trace.json into metrics.dir, which is \"\"");
  non_negative("checkpoint.interval", c.checkpoint.interval);
  positive("checkpoint.keep_last", c.checkpoint.keep_last);
}

// The world size is known only at launch: the trainer checks that expert_parallel divides it.
void check_parallel(const RunConfig& c) {
  const ParallelConfig& p = c.parallel;
  positive("parallel.expert_parallel", p.expert_parallel);
  if (c.model.moe.n_experts % p.expert_parallel != 0)
    fail({"parallel.expert_parallel", "moe.n_experts"},
         fmt::format("parallel.expert_parallel ({}) must divide moe.n_experts ({})", p.expert_parallel,
                     c.model.moe.n_experts));
  non_negative_real("parallel.bucket_mb", p.bucket_mb);
  positive("parallel.a2a_chunks", p.a2a_chunks);
  non_negative("parallel.comm_sms", p.comm_sms);
  in_range("parallel.zero", p.zero, 0, 3);
  non_negative("parallel.rebalance_interval", p.rebalance_interval);
  non_negative("parallel.rebalance_max_experts", p.rebalance_max_experts);
  const int64_t equal_share = c.model.moe.n_experts / p.expert_parallel;
  if (p.rebalance_max_experts > 0 && (p.rebalance_max_experts < equal_share || p.rebalance_max_experts > c.model.moe.n_experts))
    fail({"parallel.rebalance_max_experts", "moe.n_experts", "parallel.expert_parallel"},
         fmt::format("parallel.rebalance_max_experts ({}) must be 0 or between moe.n_experts / parallel.expert_parallel "
                     "({}) and moe.n_experts ({})",
                     p.rebalance_max_experts, equal_share, c.model.moe.n_experts));
  if (p.a2a_compression != A2aCompression::None && p.expert_parallel < 2)
    fail({"parallel.a2a_compression", "parallel.expert_parallel"},
         "parallel.a2a_compression compresses the expert-parallel exchange: it needs parallel.expert_parallel >= 2");
  if (p.split_experts && p.expert_parallel < 2)
    fail({"parallel.split_experts", "parallel.expert_parallel"},
         "parallel.split_experts shares experts between expert-parallel ranks: it needs parallel.expert_parallel >= 2");
  const MoEConfig& e = c.model.moe;
  if (e.speculative_dispatch) {
    if (!e.route_cache)
      fail({"moe.speculative_dispatch", "moe.route_cache"},
           "moe.speculative_dispatch sends rows by the routing cache's guesses: it needs moe.route_cache = true");
    else if (p.expert_parallel < 2)
      fail({"moe.speculative_dispatch", "parallel.expert_parallel"},
           "moe.speculative_dispatch starts the expert-parallel exchange early: it needs parallel.expert_parallel >= 2");
  }
}

void check_all(const RunConfig& c) {
  check_model(c.model);
  check_training(c);
  check_io(c);
  check_parallel(c);
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
      check_all(config_);
    } catch (const Issue& issue) {
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
    check_all(config);
  } catch (const Issue& issue) {
    throw ConfigError(issue.message);
  }
}

Fp8GemmBackend fp8_gemm_backend_for(const RunConfig& config, bool deepgemm_runs) {
  const Fp8GemmBackend chosen = config.training.fp8_gemm_backend;
  if (chosen != Fp8GemmBackend::Auto) return chosen;
  // The conditions validate_config puts on an explicit deepgemm, and a GPU that runs it.
  const MoEConfig& moe = config.model.moe;
  const bool allowed = config.training.precision == TrainingPrecision::Fp8 && config.parallel.expert_parallel <= 1 &&
                       config.parallel.comm_sms <= 0 && moe.n_experts <= kDeepGemmMaxExperts;
  // And little padding: each expert's rows padded to 128 add ~64 rows an expert on average,
  // which at many experts and few rows each would outweigh the faster kernel (measured
  // wins: mixtral-mini's 1.6%, -6.5 ms a step; fine-grained's 12.5%, -3.4 ms).
  const double rows = static_cast<double>(config.training.micro_batch) * static_cast<double>(config.model.seq_len) *
                      static_cast<double>(moe.top_k);
  const bool little_padding = static_cast<double>(moe.n_experts) * 64.0 <= kDeepGemmMaxPadding * rows;
  return allowed && little_padding && deepgemm_runs ? Fp8GemmBackend::DeepGemm : Fp8GemmBackend::Cutlass;
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
