// The rules a RunConfig must satisfy (config/config_rules.h): value ranges, the keys that
// go together and those that exclude each other, each broken rule one line naming its keys.
#include "config/config_rules.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "config/run_config.h"
#include "core/fp8.h"      // fp8::kBlock
#include "core/threads.h"  // kMaxThreads

namespace moe {
namespace {

// training.fp8_gemm_backend = auto: DeepGEMM's only while its padding rows are at most this
// share of a micro-batch's routed rows (measured wins at 1.6% and 12.5%, BENCHMARKS.md).
constexpr double kDeepGemmMaxPadding = 0.15;

[[noreturn]] void fail(std::vector<std::string> keys, std::string message) {
  throw RuleBroken{std::move(keys), std::move(message)};
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

// The key choosing `precision`'s GEMM kernels.
const char* gemm_backend_key(TrainingPrecision precision) {
  return precision == TrainingPrecision::Fp8 ? "training.fp8_gemm_backend" : "training.bf16_gemm_backend";
}

// Why DeepGEMM's kernels cannot run `c`'s GEMMs of `precision`, if they cannot: the rule an
// explicit deepgemm must pass, and what auto checks before choosing them.
std::optional<RuleBroken> deepgemm_refused(const RunConfig& c, TrainingPrecision precision) {
  const std::string key = gemm_backend_key(precision);
  if (c.training.precision != precision)
    return RuleBroken{{key, "training.precision"},
                      fmt::format("{} = deepgemm applies to training.precision = {} only", key,
                                  name_of(precision))};
  if (c.training.device == TrainingDevice::Cpu)
    return RuleBroken{{key, "training.device"}, fmt::format("{} = deepgemm runs on the GPU: not with training.device = cpu", key)};
  if (c.parallel.expert_parallel > 1)
    return RuleBroken{{key, "parallel.expert_parallel"},
                      fmt::format("{} = deepgemm pads the rows of a local dispatch: not with "
                                  "parallel.expert_parallel > 1",
                                  key)};
  if (c.parallel.comm_sms > 0)
    return RuleBroken{{key, "parallel.comm_sms"},
                      fmt::format("{} = deepgemm runs on every multiprocessor: set parallel.comm_sms = 0", key)};
  if (c.model.moe.n_experts > kDeepGemmMaxExperts)
    return RuleBroken{{key, "moe.n_experts"}, fmt::format("{} = deepgemm runs up to {} experts, not {}", key,
                                                          kDeepGemmMaxExperts, c.model.moe.n_experts)};
  // The bf16 kernels' tiles (fp8's scale blocks are checked with training.precision).
  if (c.model.dim % 128 != 0 || c.model.moe.expert_hidden % 128 != 0)
    return RuleBroken{{key, "model.dim", "moe.expert_hidden"},
                      fmt::format("{} = deepgemm needs model.dim ({}) and moe.expert_hidden ({}) to be multiples of "
                                  "128",
                                  key, c.model.dim, c.model.moe.expert_hidden)};
  return std::nullopt;
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
    if (c.model.dim % fp8::kBlock != 0 || c.model.moe.expert_hidden % fp8::kBlock != 0)
      fail({"training.precision", "model.dim", "moe.expert_hidden"},
           fmt::format("training.precision = fp8 needs model.dim ({}) and moe.expert_hidden ({}) to be multiples of "
                       "{} (the fp8 scale blocks)",
                       c.model.dim, c.model.moe.expert_hidden, fp8::kBlock));
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
  if (t.fp8_gemm_backend == GemmBackend::DeepGemm)
    if (std::optional<RuleBroken> refused = deepgemm_refused(c, TrainingPrecision::Fp8)) throw *refused;
  if (t.bf16_gemm_backend == GemmBackend::DeepGemm)
    if (std::optional<RuleBroken> refused = deepgemm_refused(c, TrainingPrecision::Bf16)) throw *refused;
  if (t.deterministic_attention == DeterministicAttention::Ordered && !t.deterministic)
    fail({"training.deterministic_attention", "training.deterministic"},
         "training.deterministic_attention = ordered applies to training.deterministic = true only");
  if (t.attention_query_chunks < 1 || t.attention_query_chunks > c.model.seq_len)
    fail({"training.attention_query_chunks", "model.seq_len"},
         fmt::format("training.attention_query_chunks must be between 1 and model.seq_len ({}), got {}",
                     c.model.seq_len, t.attention_query_chunks));
  if (t.attention_query_chunks > 1 && t.deterministic && t.deterministic_attention == DeterministicAttention::Ordered)
    fail({"training.attention_query_chunks", "training.deterministic_attention"},
         "training.attention_query_chunks > 1 splits the dP workspace's backward: not with "
         "training.deterministic_attention = ordered");

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
  if (c.optimizer.state_dtype == MomentDtype::Fp8 && p.expert_parallel > 1)
    fail({"optimizer.state_dtype", "parallel.expert_parallel"},
         "optimizer.state_dtype = fp8 keeps a scale per 16 moments, which expert re-placement and split experts "
         "would cut: it needs parallel.expert_parallel = 1");
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

}  // namespace

void check_run_config(const RunConfig& c) {
  check_model(c.model);
  check_training(c);
  check_io(c);
  check_parallel(c);
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

GemmBackend gemm_backend_for(const RunConfig& config, TrainingPrecision precision, bool deepgemm_runs) {
  const GemmBackend chosen = config.training.gemm_backend(precision);
  if (chosen != GemmBackend::Auto) return chosen;
  // What an explicit deepgemm must pass, a GPU that runs it, and little padding: each
  // expert's rows padded to 128 add half of that on average, which at many experts of few
  // rows would outweigh the faster kernel (measured wins, fp8: mixtral-mini's 1.6%, -6.5 ms
  // a step; fine-grained's 12.5%, -3.4 ms; bf16: -9.1, -2.9 (olmoe-mini) and -2.2 ms).
  const MoEConfig& moe = config.model.moe;
  const double rows = static_cast<double>(config.training.micro_batch) * static_cast<double>(config.model.seq_len) *
                      static_cast<double>(moe.top_k);
  const double mean_padding = static_cast<double>(fp8::kBlock) / 2;
  const bool little_padding = static_cast<double>(moe.n_experts) * mean_padding <= kDeepGemmMaxPadding * rows;
  return !deepgemm_refused(config, precision) && little_padding && deepgemm_runs ? GemmBackend::DeepGemm
                                                                       : GemmBackend::Cutlass;
}

}  // namespace moe
