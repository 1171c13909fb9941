#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>

#include "train/hardware_description.h"
#include "core/error.h"
#include "config/run_config.h"
#include "dist/single_communicator.h"
#include "model/gpu_buffer_sizes.h"
#include "train/backends/backend_factory.h"
#include "expect_error.h"

namespace moe {
namespace {

std::filesystem::path source_dir() {
  if (const char* dir = std::getenv("MOE_SOURCE_DIR"); dir && *dir) return dir;
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// "section.key" for every key config_to_toml writes.
std::vector<std::string> written_keys(const RunConfig& config) {
  std::vector<std::string> keys;
  toml::table root = toml::parse(config_to_toml(config));
  for (const auto& [section, table] : root)
    for (const auto& [key, value] : *table.as_table()) keys.push_back(std::string(section.str()) + "." + std::string(key.str()));
  return keys;
}

// Runs `fn`, expects a one-line ConfigError containing every fragment.
void expect_config_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  test::expect_one_line_error<ConfigError>(fn, fragments);
}

void expect_override_error(const std::string& override_text, const std::vector<std::string>& fragments) {
  SCOPED_TRACE(override_text);
  auto fragments_with_source = fragments;
  fragments_with_source.push_back("command line");
  expect_config_error([&] { parse_config("", "x.toml", {override_text}); }, fragments_with_source);
}

TEST(Config, DefaultsValidateAndRoundTrip) {
  RunConfig defaults;
  EXPECT_NO_THROW(validate_config(defaults));
  std::string text = config_to_toml(defaults);
  EXPECT_EQ(config_to_toml(parse_config(text, "written")), text);
  // An empty file is the built-in defaults.
  EXPECT_EQ(config_to_toml(parse_config("", "empty.toml")), text);
}

TEST(Config, DefaultTomlLoadsAndSetsEveryKey) {
  auto path = source_dir() / "configs/default.toml";
  RunConfig config = load_config(path.string());
  EXPECT_EQ(config.model.dim, 128);
  EXPECT_EQ(config.model.moe.n_experts, 8);
  EXPECT_EQ(config.training.global_batch_tokens % (config.training.micro_batch * config.model.seq_len), 0);
  // A complete example: every key appears in the file.
  toml::table file = toml::parse_file(path.string());
  for (const auto& key : written_keys(config)) EXPECT_TRUE(file.at_path(key)) << key << " missing in default.toml";
}

// Every config the repository ships loads and validates; the real-size ones have the
// shapes they are named for (issue 19: Mixtral-8x7B and the write-up's 128-expert model).
TEST(Config, EveryShippedConfigLoadsAndTheRealSizedOnesHaveTheirShapes) {
  int loaded = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(source_dir() / "configs"))
    if (entry.path().extension() == ".toml") {
      // configs/hardware/ holds the step simulator's hardware descriptions, not run configs.
      if (entry.path().parent_path().filename() == "hardware")
        EXPECT_NO_THROW(load_hardware_description(entry.path().string())) << entry.path();
      else
        EXPECT_NO_THROW(load_config(entry.path().string())) << entry.path();
      ++loaded;
    }
  EXPECT_GE(loaded, 5);
  const RunConfig mixtral = load_config((source_dir() / "configs/models/mixtral-8x7b.toml").string());
  EXPECT_EQ(mixtral.model.n_layers, 32);
  EXPECT_EQ(mixtral.model.dim, 4096);
  EXPECT_EQ(mixtral.model.n_heads, 32);
  EXPECT_EQ(mixtral.model.n_kv_heads, 8);
  EXPECT_EQ(mixtral.model.vocab_size, 32000);
  EXPECT_DOUBLE_EQ(mixtral.model.rope_theta, 1e6);
  EXPECT_EQ(mixtral.model.moe.n_experts, 8);
  EXPECT_EQ(mixtral.model.moe.expert_hidden, 14336);
  EXPECT_EQ(mixtral.model.moe.top_k, 2);
  const RunConfig writeup = load_config((source_dir() / "configs/models/writeup-500b.toml").string());
  EXPECT_EQ(writeup.model.moe.n_experts, 128);
  EXPECT_EQ(writeup.model.moe.top_k, 2);
  EXPECT_EQ(writeup.model.moe.expert_hidden, 8192);
  EXPECT_DOUBLE_EQ(writeup.model.moe.capacity_factor, 1.25);
  EXPECT_DOUBLE_EQ(writeup.model.moe.temperature, 0.3);
  // About 500 B parameters: experts, attention (GQA), routers and the two embeddings.
  const ModelConfig& m = writeup.model;
  const double kv = static_cast<double>(m.dim) * m.n_kv_heads / m.n_heads;
  const double per_layer = 3.0 * m.dim * m.moe.expert_hidden * m.moe.n_experts + 2.0 * m.dim * m.dim +
                           2.0 * m.dim * kv + static_cast<double>(m.dim) * m.moe.n_experts;
  const double total = per_layer * m.n_layers + 2.0 * m.vocab_size * m.dim;
  EXPECT_NEAR(total / 1e9, 500, 10);
}

TEST(Config, OverridesParseTomlValuesAndBareStrings) {
  RunConfig c = parse_config("[model]\ndim = 64\n", "x.toml",
                             {"model.dim=256", "--lr.peak=1e-3", "moe.temperature=2", "model.tie_embeddings=true",
                              "data.dir=/tmp/some dir", "data.extension=\".md\"", "moe.score_func=sigmoid",
                              "metrics.dir=", "training.seed=7", "training.seed=8"});
  EXPECT_EQ(c.model.dim, 256);
  EXPECT_DOUBLE_EQ(c.lr.peak, 1e-3);
  EXPECT_DOUBLE_EQ(c.model.moe.temperature, 2.0);  // an integer where a float is expected
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.data.dir, "/tmp/some dir");
  EXPECT_EQ(c.data.extension, ".md");
  EXPECT_EQ(c.model.moe.score_func, ScoreFunc::Sigmoid);
  EXPECT_EQ(c.metrics.dir, "");
  EXPECT_EQ(c.training.seed, 8u);  // the last override wins
  // A string key given a number keeps the text.
  EXPECT_EQ(parse_config("", "x", {"metrics.dir=123"}).metrics.dir, "123");
}

TEST(Config, FileErrorsNameFileLineAndKey) {
  auto parse = [](const std::string& text) { return [text] { parse_config(text, "configs/x.toml"); }; };
  expect_config_error(parse("[model]\ndimm = 3\n"),
                      {"configs/x.toml:2:1", "unknown key 'model.dimm'", "known keys in [model]", "n_heads"});
  expect_config_error(parse("[model]\ndim = -3\n"), {"configs/x.toml:2:7", "model.dim", "positive integer", "-3"});
  expect_config_error(parse("[moe]\nscore_func = \"relu\"\n"),
                      {"configs/x.toml:2", "moe.score_func", "softmax, sigmoid", "\"relu\""});
  expect_config_error(parse("[model]\ndim = \"abc\"\n"), {"configs/x.toml:2", "model.dim", "integer", "string"});
  expect_config_error(parse("[model]\ndim = 1.5\n"), {"model.dim", "integer", "1.5"});
  expect_config_error(parse("[model]\ntie_embeddings = 1\n"), {"model.tie_embeddings", "true or false"});
  expect_config_error(parse("[data]\ndir = 3\n"), {"data.dir", "string"});
  expect_config_error(parse("[model]\ndim = [1, 2]\n"), {"model.dim", "array"});
  expect_config_error(parse("[model]\ndim = 128\n\n[modle]\ndim = 3\n"),
                      {"configs/x.toml:4", "unknown section [modle]", "known sections", "checkpoint"});
  expect_config_error(parse("dim = 3\n"), {"configs/x.toml:1", "'dim'", "outside any section"});
  expect_config_error(parse("model = 3\n"), {"configs/x.toml:1", "'model'", "section"});
  expect_config_error(parse("[model]\ndim = = 3\n"), {"configs/x.toml:2", "TOML syntax error"});
  expect_config_error(parse("[model.moe]\nn_experts = 3\n"), {"unknown key 'model.moe'"});
  // A renamed key names its successor.
  expect_config_error(parse("[parallel]\nshard_optimizer = false\n"),
                      {"configs/x.toml:2", "parallel.shard_optimizer was replaced by parallel.zero", "false: zero = 0"});
  expect_config_error(parse("[parallel]\nzero = 4\n"), {"configs/x.toml:2", "parallel.zero must be at most 3, got 4"});
  expect_config_error(parse("[parallel]\nzero = -1\n"), {"parallel.zero must be an integer >= 0, got -1"});
  // Several problems: the first in the file is reported.
  expect_config_error(parse("[training]\nsteps = \"x\"\n[data]\nbogus = 1\n"), {"configs/x.toml:2", "training.steps"});
}

TEST(Config, MissingFileIsAConfigError) {
  expect_config_error([] { load_config("/nonexistent/run.toml"); }, {"/nonexistent/run.toml", "does not exist"});
  expect_config_error([] { load_config("/tmp"); }, {"/tmp", "directory"});
}

TEST(Config, OverrideErrorsNameKey) {
  expect_override_error("model.dimm=3", {"unknown key 'model.dimm'", "known keys in [model]"});
  expect_override_error("modle.dim=3", {"unknown section [modle]"});
  expect_override_error("model.dim", {"model.dim", "section.key=value"});
  expect_override_error("dim=3", {"dim=3", "section.key=value"});
  expect_override_error("model.dim=abc", {"model.dim", "integer", "abc"});
  expect_override_error("moe.top_k=0.5", {"moe.top_k", "integer"});
  expect_override_error("model.tie_embeddings=yes", {"model.tie_embeddings", "true or false"});
  expect_override_error("training.seed=-1", {"training.seed", "non-negative"});
}

TEST(Config, ValidationRulesNameTheirKeys) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"model.vocab_size=-1", {"model.vocab_size"}},
      {"model.vocab_size=100", {"model.vocab_size", "257"}},
      {"model.dim=0", {"model.dim", "positive"}},
      {"model.n_layers=0", {"model.n_layers"}},
      {"model.n_heads=-2", {"model.n_heads"}},
      {"model.n_kv_heads=0", {"model.n_kv_heads"}},
      {"model.seq_len=0", {"model.seq_len"}},
      {"model.dim=130", {"model.dim", "model.n_heads", "divisible"}},
      {"model.dim=12", {"head dimension", "even"}},  // 12 / 4 = 3
      {"model.n_kv_heads=3", {"model.n_heads", "model.n_kv_heads", "multiple"}},
      {"model.first_dense_layers=5", {"model.first_dense_layers", "model.n_layers"}},
      {"model.first_dense_layers=-1", {"model.first_dense_layers"}},
      {"model.dense_hidden=0", {"model.dense_hidden"}},
      {"model.rope_theta=0", {"model.rope_theta"}},
      {"model.norm_eps=-1e-5", {"model.norm_eps"}},
      {"model.init_std=nan", {"model.init_std"}},
      {"moe.n_experts=0", {"moe.n_experts"}},
      {"moe.top_k=0", {"moe.top_k", "moe.n_experts"}},
      {"moe.top_k=9", {"moe.top_k", "between 1 and moe.n_experts (8)"}},
      {"moe.expert_hidden=0", {"moe.expert_hidden"}},
      {"moe.n_shared_experts=-1", {"moe.n_shared_experts"}},
      {"moe.temperature=0", {"moe.temperature", "> 0"}},
      {"moe.temperature=inf", {"moe.temperature"}},
      {"moe.capacity_factor=-0.5", {"moe.capacity_factor", ">= 0"}},
      {"moe.aux_loss_coef=-1", {"moe.aux_loss_coef"}},
      {"moe.z_loss_coef=-1", {"moe.z_loss_coef"}},
      {"moe.bias_update_rate=-1", {"moe.bias_update_rate"}},
      {"moe.temperature_min=0", {"moe.temperature_min", "> 0"}},
      {"moe.temperature_max=nan", {"moe.temperature_max"}},
      {"moe.temperature_gain=0", {"moe.temperature_gain", "> 0"}},
      {"moe.temperature_min=5", {"moe.temperature_min", "moe.temperature_max", "<="}},
      {"training.steps=0", {"training.steps"}},
      {"training.micro_batch=0", {"training.micro_batch"}},
      {"training.global_batch_tokens=8000",
       {"training.global_batch_tokens", "training.micro_batch", "model.seq_len", "2048", "6144, 8192"}},
      {"training.global_batch_tokens=1000", {"training.global_batch_tokens", "nearest valid: 2048"}},
      {"training.global_batch_tokens=0", {"training.global_batch_tokens"}},
      {"training.threads=-1", {"training.threads"}},
      {"training.threads=1025", {"training.threads must be between 0 (all cores) and 1024, got 1025"}},
      {"training.device=tpu", {"training.device", "auto, cpu, cuda", "\"tpu\""}},
      {"training.grad_clip=-1", {"training.grad_clip"}},
      {"training.expert_grad_clip=-1", {"training.expert_grad_clip"}},
      {"training.val_interval=-1", {"training.val_interval"}},
      {"training.val_batches=0", {"training.val_batches"}},
      {"optimizer.beta1=1.0", {"optimizer.beta1", "[0, 1)"}},
      {"optimizer.beta2=-0.1", {"optimizer.beta2"}},
      {"optimizer.eps=0", {"optimizer.eps"}},
      {"optimizer.weight_decay=-0.1", {"optimizer.weight_decay"}},
      {"optimizer.state_dtype=fp16", {"optimizer.state_dtype", "fp32, bf16, fp8", "\"fp16\""}},
      {"lr.peak=0", {"lr.peak"}},
      {"lr.warmup_steps=-1", {"lr.warmup_steps"}},
      {"lr.min_ratio=1.5", {"lr.min_ratio", "[0, 1]"}},
      {"data.dir=", {"data.dir"}},
      {"data.tokenizer=bpe", {"data.tokenizer", "byte"}},
      {"data.tokenizer=bpe:12", {"data.tokenizer", "bpe:<vocab size"}},
      {"data.tokenizer=tok.txt", {"data.tokenizer", "tokenizer.json"}},
      {"data.val_fraction=0", {"data.val_fraction", "(0, 1)"}},
      {"data.val_fraction=1", {"data.val_fraction"}},
      {"data.max_bytes=-1", {"data.max_bytes"}},
      {"metrics.log_interval=0", {"metrics.log_interval"}},
      {"metrics.trace=true", {"metrics.trace", "metrics.dir"}},
      {"checkpoint.interval=-1", {"checkpoint.interval"}},
      {"checkpoint.keep_last=0", {"checkpoint.keep_last"}},
      {"parallel.expert_parallel=3", {"parallel.expert_parallel", "moe.n_experts"}},
      {"parallel.all_to_all=ring", {"parallel.all_to_all"}},
      {"parallel.a2a_chunks=0", {"parallel.a2a_chunks"}},
      {"parallel.comm_sms=-1", {"parallel.comm_sms"}},
      {"parallel.rebalance_max_experts=-1", {"parallel.rebalance_max_experts"}},
      {"parallel.rebalance_max_experts=9", {"parallel.rebalance_max_experts"}},
      {"parallel.grad_reduce_dtype=fp16", {"parallel.grad_reduce_dtype"}},
      {"parallel.rebalance_interval=-1", {"parallel.rebalance_interval"}},
      {"parallel.split_experts=true", {"parallel.split_experts", "parallel.expert_parallel"}},
      {"moe.route_groups=3", {"moe.route_groups", "moe.n_experts"}},
      {"moe.route_groups=4", {"moe.route_top_groups"}},
      {"moe.route_cache_predict=1", {"moe.route_cache_predict", "moe.top_k (2)"}},
      {"moe.route_cache_predict=9", {"moe.route_cache_predict", "moe.n_experts (8)"}},
      {"moe.route_cache_keys=-1", {"moe.route_cache_keys"}},
      {"moe.merge_interval=-1", {"moe.merge_interval"}},
      {"moe.merge_similarity=1.5", {"moe.merge_similarity", "between -1 and 1"}},
      {"moe.merge_noise=1", {"moe.merge_noise"}},
      {"moe.merge_pairs=0", {"moe.merge_pairs"}},
      {"parallel.bucket_mb=-1", {"parallel.bucket_mb"}},
      {"parallel.backend=gloo", {"parallel.backend"}},
      {"metrics.peak_tflops=0", {"metrics.peak_tflops", "> 0"}},
      {"metrics.alert_imbalance=-0.1", {"metrics.alert_imbalance"}},
      {"metrics.alert_comm_wait=-1", {"metrics.alert_comm_wait"}},
      {"metrics.alert_grad_sync_ms=-5", {"metrics.alert_grad_sync_ms"}},
      {"training.stop_at=-1", {"training.stop_at", "training.steps"}},
      {"training.stop_at=301", {"training.stop_at", "between 0 and training.steps (300)"}},
      {"training.nan_max_skips=-1", {"training.nan_max_skips"}},
      {"training.nan_lr_factor=0", {"training.nan_lr_factor", "(0, 1]"}},
      {"training.nan_lr_factor=1.5", {"training.nan_lr_factor"}},
      {"training.loss_spike_factor=0.5", {"training.loss_spike_factor", "> 1"}},
      {"training.memory_limit_mb=-1", {"training.memory_limit_mb"}},
      {"training.recompute_layers=-2", {"training.recompute_layers"}},
      {"training.recompute_experts=some", {"training.recompute_experts"}},
      {"training.recompute_experts_layers=-2", {"training.recompute_experts_layers", "count of MoE layers"}},
      {"training.expert_grad_dtype=fp16", {"training.expert_grad_dtype", "fp32, bf16", "\"fp16\""}},
      {"training.precision=fp16", {"training.precision"}},
      {"training.deterministic_attention=fifo", {"training.deterministic_attention", "workspace, ordered"}},
  };
  for (const auto& [override_text, fragments] : cases) expect_override_error(override_text, fragments);
}

// training.deterministic_attention: the workspace form by default; the ordered form only
// where the run is deterministic (with atomics there is no order to choose).
TEST(Config, OrderedAttentionNeedsADeterministicRun) {
  EXPECT_EQ(RunConfig{}.training.deterministic_attention, DeterministicAttention::Workspace);
  EXPECT_EQ(parse_config("", "x.toml", {"training.deterministic_attention=ordered"}).training.deterministic_attention,
            DeterministicAttention::Ordered);
  EXPECT_NO_THROW(parse_config("", "x.toml", {"training.deterministic=false"}));
  expect_config_error(
      [] { parse_config("", "x.toml", {"training.deterministic=false", "training.deterministic_attention=ordered"}); },
      {"training.deterministic_attention = ordered", "training.deterministic = true"});
}

// training.attention_query_chunks: one call by default; 1 to seq_len chunks; not with the
// ordered form (its engine takes no chunk's shapes).
TEST(Config, AttentionQueryChunksBetweenOneAndTheSequence) {
  EXPECT_EQ(RunConfig{}.training.attention_query_chunks, 1);
  EXPECT_EQ(parse_config("", "x.toml", {"training.attention_query_chunks=4"}).training.attention_query_chunks, 4);
  expect_config_error([] { parse_config("", "x.toml", {"training.attention_query_chunks=0"}); },
                      {"training.attention_query_chunks", "between 1 and model.seq_len", "got 0"});
  const RunConfig defaults;
  const std::string too_many = "training.attention_query_chunks=" + std::to_string(defaults.model.seq_len + 1);
  expect_config_error([&] { parse_config("", "x.toml", {too_many}); },
                      {"training.attention_query_chunks", std::to_string(defaults.model.seq_len)});
  expect_config_error(
      [] {
        parse_config("", "x.toml", {"training.attention_query_chunks=2", "training.deterministic_attention=ordered"});
      },
      {"training.attention_query_chunks > 1", "training.deterministic_attention = ordered"});
  EXPECT_NO_THROW(parse_config("", "x.toml", {"training.attention_query_chunks=2", "training.deterministic=false"}));
}

// moe.speculative_dispatch: off by default; needs the routing cache and expert parallelism.
TEST(Config, SpeculativeDispatchNeedsRouteCacheAndExpertParallelism) {
  EXPECT_FALSE(RunConfig{}.model.moe.speculative_dispatch);
  expect_config_error([] { parse_config("", "x.toml", {"moe.speculative_dispatch=true"}); },
                      {"moe.speculative_dispatch", "moe.route_cache = true"});
  expect_config_error([] { parse_config("", "x.toml", {"moe.speculative_dispatch=true", "moe.route_cache=true"}); },
                      {"moe.speculative_dispatch", "parallel.expert_parallel >= 2"});
  const RunConfig ok = parse_config("", "x.toml", {"moe.speculative_dispatch=true", "moe.route_cache=true",
                                                   "parallel.expert_parallel=2"});
  EXPECT_TRUE(ok.model.moe.speculative_dispatch);
}

// training.precision = fp8: the GPU only, dims in whole 128-blocks; bf16 by default.
TEST(Config, Fp8PrecisionNeedsTheGpuAndDimsOf128) {
  EXPECT_EQ(RunConfig{}.training.precision, TrainingPrecision::Bf16);
  expect_config_error([] { parse_config("", "x.toml", {"training.precision=fp8", "training.device=cpu"}); },
                      {"training.precision = fp8 runs on the GPU only", "training.device"});
  expect_config_error(
      [] { parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda", "moe.expert_hidden=200"}); },
      {"training.precision = fp8", "moe.expert_hidden (200)", "multiples of 128"});
  const RunConfig fp8 = parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda"});
  EXPECT_EQ(fp8.training.precision, TrainingPrecision::Fp8);
  EXPECT_TRUE(fp8.training.fp8_weight_cache);
  EXPECT_FALSE(parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda",
                                            "training.fp8_weight_cache=false"})
                   .training.fp8_weight_cache);
  expect_config_error([] { parse_config("", "x.toml", {"training.fp8_weight_cache=false"}); },
                      {"training.fp8_weight_cache = false", "training.precision = fp8"});
  EXPECT_FALSE(fp8.training.fp8_weight_gradients);
  EXPECT_TRUE(parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda",
                                           "training.fp8_weight_gradients=true"})
                  .training.fp8_weight_gradients);
  expect_config_error([] { parse_config("", "x.toml", {"training.fp8_weight_gradients=true"}); },
                      {"training.fp8_weight_gradients = true", "training.precision = fp8"});
  EXPECT_EQ(fp8.training.fp8_weight_gradient_scales, Fp8ColumnScales::Tile1x128);
  EXPECT_EQ(parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda",
                                         "training.fp8_weight_gradients=true",
                                         "training.fp8_weight_gradient_scales=128x128"})
                .training.fp8_weight_gradient_scales,
            Fp8ColumnScales::Block128x128);
  expect_config_error(
      [] {
        parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda",
                                    "training.fp8_weight_gradient_scales=128x128"});
      },
      {"training.fp8_weight_gradient_scales = 128x128", "training.fp8_weight_gradients = true"});
  expect_config_error([] { parse_config("", "x.toml", {"training.fp8_weight_gradient_scales=1x64"}); },
                      {"training.fp8_weight_gradient_scales"});
  // The experts' fp8 GEMMs: auto by default (DeepGEMM's over padded rows where the run allows
  // it and the GPU runs it, else CUTLASS's), either on request.
  EXPECT_EQ(fp8.training.fp8_gemm_backend, GemmBackend::Auto);
  // 8 x 1,024 tokens top-2 over 8 experts: ~512 padding rows on 16,384 routed (3%).
  const std::vector<std::string> long_rows = {"training.precision=fp8", "training.device=cuda", "model.seq_len=1024"};
  const RunConfig deepgemm_fits = parse_config("", "x.toml", long_rows);
  EXPECT_EQ(gemm_backend_for(deepgemm_fits, TrainingPrecision::Fp8, true), GemmBackend::DeepGemm);
  EXPECT_EQ(gemm_backend_for(deepgemm_fits, TrainingPrecision::Fp8, false), GemmBackend::Cutlass);  // not an H100 / H200, or no GPU
  // Each refused: bf16, expert parallelism, SMs left to communication, more experts than
  // compiled, and padding past 15% (8 x 128 tokens: 25%; the defaults' 8 x 256: 12.5% is not).
  EXPECT_EQ(gemm_backend_for(parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda"}),
                             TrainingPrecision::Fp8, true),
            GemmBackend::DeepGemm);
  for (const std::string refusal : {"training.precision=bf16", "parallel.expert_parallel=2", "parallel.comm_sms=8",
                                    "moe.n_experts=512", "model.seq_len=128"}) {
    std::vector<std::string> keys = long_rows;
    keys.push_back(refusal);
    if (refusal == "parallel.expert_parallel=2") keys.push_back("parallel.backend=nccl");
    const RunConfig c = parse_config("", "x.toml", keys);
    EXPECT_EQ(gemm_backend_for(c, TrainingPrecision::Fp8, true), GemmBackend::Cutlass) << refusal;
  }
  for (const GemmBackend explicit_choice : {GemmBackend::Cutlass, GemmBackend::DeepGemm}) {
    RunConfig c = fp8;
    c.training.fp8_gemm_backend = explicit_choice;
    EXPECT_EQ(gemm_backend_for(c, TrainingPrecision::Fp8, false), explicit_choice);
    EXPECT_EQ(gemm_backend_for(c, TrainingPrecision::Fp8, true), explicit_choice);
  }
  EXPECT_EQ(expert_row_align(fp8.training), 1) << "auto unresolved pads nothing";
  EXPECT_EQ(parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda",
                                         "training.fp8_gemm_backend=deepgemm"})
                .training.fp8_gemm_backend,
            GemmBackend::DeepGemm);
  expect_config_error([] { parse_config("", "x.toml", {"training.fp8_gemm_backend=deepgemm"}); },
                      {"training.fp8_gemm_backend = deepgemm", "training.precision = fp8"});
  expect_config_error(
      [] {
        parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda", "training.fp8_gemm_backend=deepgemm",
                                    "parallel.expert_parallel=2"});
      },
      {"training.fp8_gemm_backend = deepgemm", "parallel.expert_parallel > 1"});
  expect_config_error([] { parse_config("", "x.toml", {"training.fp8_gemm_backend=triton"}); },
                      {"training.fp8_gemm_backend"});
  // The bf16 experts' GEMMs: auto by default (DeepGEMM's under the fp8 key's rules, for bf16
  // runs only), either on request.
  const RunConfig bf16 = parse_config("", "x.toml", {});
  EXPECT_EQ(bf16.training.bf16_gemm_backend, GemmBackend::Auto);
  EXPECT_EQ(expert_row_align(bf16.training), 1) << "auto unresolved pads nothing";
  const RunConfig bf16_deepgemm =
      parse_config("", "x.toml", {"training.device=cuda", "training.bf16_gemm_backend=deepgemm"});
  EXPECT_EQ(bf16_deepgemm.training.bf16_gemm_backend, GemmBackend::DeepGemm);
  EXPECT_EQ(expert_row_align(bf16_deepgemm.training), 128);
  RunConfig bf16_fp8_key = bf16_deepgemm;
  bf16_fp8_key.training.precision = TrainingPrecision::Fp8;  // the bf16 key does not pad an fp8 run
  EXPECT_EQ(expert_row_align(bf16_fp8_key.training), 1);
  std::vector<std::string> bf16_long = {"training.device=cuda", "model.seq_len=1024", "training.bf16_gemm_backend=auto"};
  EXPECT_EQ(gemm_backend_for(parse_config("", "x.toml", bf16_long), TrainingPrecision::Bf16, true),
            GemmBackend::DeepGemm);
  EXPECT_EQ(gemm_backend_for(parse_config("", "x.toml", bf16_long), TrainingPrecision::Bf16, false),
            GemmBackend::Cutlass);
  // Each key for its own precision: an explicit bf16 choice stands beside an fp8 auto.
  std::vector<std::string> bf16_cutlass = bf16_long;
  bf16_cutlass.back() = "training.bf16_gemm_backend=cutlass";
  EXPECT_EQ(gemm_backend_for(parse_config("", "x.toml", bf16_cutlass), TrainingPrecision::Bf16, true),
            GemmBackend::Cutlass);
  bf16_long.push_back("parallel.comm_sms=8");
  EXPECT_EQ(gemm_backend_for(parse_config("", "x.toml", bf16_long), TrainingPrecision::Bf16, true),
            GemmBackend::Cutlass);
  expect_config_error(
      [] { parse_config("", "x.toml", {"training.precision=fp8", "training.device=cuda", "training.bf16_gemm_backend=deepgemm"}); },
      {"training.bf16_gemm_backend = deepgemm", "training.precision = bf16"});
  expect_config_error([] { parse_config("", "x.toml", {"training.device=cpu", "training.bf16_gemm_backend=deepgemm"}); },
                      {"training.bf16_gemm_backend = deepgemm", "training.device = cpu"});
  expect_config_error(
      [] {
        parse_config("", "x.toml", {"training.device=cuda", "training.bf16_gemm_backend=deepgemm", "model.dim=192"});
      },
      {"training.bf16_gemm_backend = deepgemm", "model.dim (192)", "multiples of 128"});
  expect_config_error(
      [] {
        parse_config("", "x.toml", {"training.device=cuda", "training.bf16_gemm_backend=deepgemm",
                                    "parallel.expert_parallel=2", "parallel.backend=nccl"});
      },
      {"training.bf16_gemm_backend = deepgemm", "parallel.expert_parallel > 1"});
  // device = auto that resolves to the CPU (no GPU visible): refused when the backend is made.
  RunConfig on_auto = parse_config("", "x.toml", {"training.precision=fp8", "model.vocab_size=512"});
  if (wants_gpu(on_auto.training)) GTEST_SKIP() << "a GPU is visible: auto resolves to it";
  expect_config_error([&] { make_backend(on_auto, dist::make_single_communicator()); },
                      {"training.precision = fp8 runs on the GPU only", "resolved to the CPU"});
}

// moe.temperature_control's combinations, one line each naming the keys.
TEST(Config, Fp8MomentsNeedNoExpertParallelism) {
  expect_config_error(
      [] { parse_config("", "x.toml", {"optimizer.state_dtype=fp8", "parallel.expert_parallel=2"}); },
      {"optimizer.state_dtype", "parallel.expert_parallel = 1"});
  EXPECT_EQ(parse_config("", "x.toml", {"optimizer.state_dtype=fp8"}).optimizer.state_dtype, MomentDtype::Fp8);
}

TEST(Config, TemperatureControlCombinationsAreRefused) {
  auto refused = [](std::vector<std::string> overrides, const std::vector<std::string>& fragments) {
    SCOPED_TRACE(overrides.back());
    overrides.insert(overrides.begin(), "moe.temperature_control=true");
    expect_config_error([&] { parse_config("", "x.toml", overrides); }, fragments);
  };
  refused({"moe.temperature=8"}, {"moe.temperature", "moe.temperature_min", "moe.temperature_max", "[0.25, 4]"});
  refused({"moe.temperature_min=1.5"}, {"moe.temperature (1)", "within"});
  refused({"moe.aux_loss_coef=0"}, {"moe.temperature_control", "moe.aux_loss_coef", "moe.bias_balancing"});
  EXPECT_NO_THROW(parse_config("", "x.toml", {"moe.temperature_control=true", "moe.aux_loss_coef=0",
                                              "moe.bias_balancing=true"}));
  EXPECT_NO_THROW(parse_config("", "x.toml", {"moe.temperature_control=true"}));
  EXPECT_FALSE(RunConfig{}.model.moe.temperature_control);  // off by default
}

// Shapes past these bounds are typos; n_layers = 1000000 used to hang while the model was
// built. Each bound is allowed, one past it is not.
TEST(Config, ModelShapesHaveUpperBounds) {
  const std::vector<std::pair<std::string, int64_t>> bounds = {
      {"model.dim", 65536},          {"model.n_layers", 1024},        {"model.n_heads", 1024},
      {"model.n_kv_heads", 1024},    {"model.seq_len", 1048576},      {"model.dense_hidden", 1048576},
      {"moe.n_experts", 65536},      {"moe.expert_hidden", 1048576},  {"moe.n_shared_experts", 1024},
  };
  for (const auto& [key, bound] : bounds) {
    SCOPED_TRACE(key);
    // Keep the other rules satisfied at the bound: heads divide dim into even head sizes.
    std::vector<std::string> at = {key + "=" + std::to_string(bound)};
    if (key == "model.n_heads" || key == "model.n_kv_heads")
      at.insert(at.end(), {"model.dim=4096", "model.n_heads=1024", "model.n_kv_heads=1024"});
    if (key == "model.n_heads") at.back() = "model.n_kv_heads=1";
    if (key == "model.seq_len") at.push_back("training.global_batch_tokens=8388608");
    EXPECT_NO_THROW(parse_config("", "run.toml", at));
    expect_override_error(key + "=" + std::to_string(bound + 1),
                          {key + " must be at most " + std::to_string(bound) + ", got " + std::to_string(bound + 1)});
  }
}

TEST(Config, ValidationBlamesWhereTheValueCameFrom) {
  // Set in the file: the file's line. Broken by an override: the command line.
  expect_config_error([] { parse_config("[moe]\n\ntop_k = 9\n", "run.toml"); }, {"run.toml:3:9: moe.top_k"});
  expect_config_error([] { parse_config("[model]\ndim = 128\n", "run.toml", {"model.n_heads=5"}); },
                      {"command line: model.dim (128) must be divisible by model.n_heads (5)"});
  // validate_config on its own has no source, only the key.
  RunConfig c;
  c.model.moe.top_k = 0;
  expect_config_error([&] { validate_config(c); }, {"moe.top_k"});
}

// Each change touches one field through the struct, not through config.cpp's key list,
// so a field that config_to_toml forgets to write or parse_config to read fails here.
TEST(Config, EveryFieldRoundTrips) {
  const std::vector<std::function<void(RunConfig&)>> changes = {
      [](RunConfig& c) { c.model.vocab_size = 300; }, [](RunConfig& c) { c.model.dim = 256; },
      [](RunConfig& c) { c.model.n_layers = 2; }, [](RunConfig& c) { c.model.n_heads = 8; },
      [](RunConfig& c) { c.model.n_kv_heads = 4; }, [](RunConfig& c) { c.model.seq_len = 64; },
      [](RunConfig& c) { c.model.first_dense_layers = 1; }, [](RunConfig& c) { c.model.dense_hidden = 100; },
      [](RunConfig& c) { c.model.rope_theta = 5e5; }, [](RunConfig& c) { c.model.norm_eps = 1e-6; },
      [](RunConfig& c) { c.model.tie_embeddings = true; }, [](RunConfig& c) { c.model.init_std = 0.1 + 0.2; },
      [](RunConfig& c) { c.model.moe.n_experts = 16; }, [](RunConfig& c) { c.model.moe.top_k = 1; },
      [](RunConfig& c) { c.model.moe.expert_hidden = 96; }, [](RunConfig& c) { c.model.moe.n_shared_experts = 1; },
      [](RunConfig& c) { c.model.moe.score_func = ScoreFunc::Sigmoid; },
      [](RunConfig& c) { c.model.moe.temperature = 0.7; }, [](RunConfig& c) { c.model.moe.renormalize = false; },
      [](RunConfig& c) { c.model.moe.capacity_factor = 1.25; },
      [](RunConfig& c) { c.model.moe.aux_loss_coef = 0; }, [](RunConfig& c) { c.model.moe.z_loss_coef = 1e-4; },
      [](RunConfig& c) { c.model.moe.bias_balancing = true; },
      [](RunConfig& c) { c.model.moe.bias_update_rate = 1.0 / 3; }, [](RunConfig& c) { c.training.steps = 5; },
      [](RunConfig& c) { c.model.moe.temperature_control = true; },
      [](RunConfig& c) { c.model.moe.temperature_min = 0.125; }, [](RunConfig& c) { c.model.moe.temperature_max = 8; },
      [](RunConfig& c) { c.model.moe.temperature_gain = 0.2; },
      [](RunConfig& c) { c.training.global_batch_tokens = 2048; }, [](RunConfig& c) { c.training.micro_batch = 4; },
      [](RunConfig& c) { c.training.seed = 9223372036854775807ull; }, [](RunConfig& c) { c.training.threads = 2; },
      [](RunConfig& c) { c.training.device = TrainingDevice::Cpu; }, [](RunConfig& c) { c.training.grad_clip = 0; },
      [](RunConfig& c) { c.training.expert_grad_clip = 0.5; }, [](RunConfig& c) { c.training.val_interval = 0; },
      [](RunConfig& c) { c.training.val_batches = 2; }, [](RunConfig& c) { c.optimizer.beta1 = 0.8; },
      [](RunConfig& c) { c.optimizer.beta2 = 0.999; }, [](RunConfig& c) { c.optimizer.eps = 1e-10; },
      [](RunConfig& c) { c.optimizer.weight_decay = 0; }, [](RunConfig& c) { c.optimizer.state_dtype = MomentDtype::Bf16; },
      [](RunConfig& c) { c.lr.peak = 1e-4; },
      [](RunConfig& c) { c.lr.warmup_steps = 0; }, [](RunConfig& c) { c.lr.min_ratio = 1; },
      [](RunConfig& c) { c.data.dir = "/a \"quoted\" \\ dir\twith\ttabs"; },
      [](RunConfig& c) { c.data.extension = ""; }, [](RunConfig& c) { c.data.val_fraction = 0.5; },
      [](RunConfig& c) { c.data.max_bytes = 1 << 20; }, [](RunConfig& c) { c.metrics.log_interval = 1; },
      [](RunConfig& c) { c.data.shards = "/tmp/shards"; }, [](RunConfig& c) { c.data.tokenizer = "bpe:4096"; },
      [](RunConfig& c) { c.data.text_field = "content"; },
      // data.sources excludes data.shards: the blend of every change drops the shards.
      [](RunConfig& c) { c.data.sources = "0.7:/a dir,0.3:/b_text_document", c.data.shards = ""; },
      [](RunConfig& c) { c.metrics.dir = "runs/a"; }, [](RunConfig& c) { c.checkpoint.dir = "ckpt"; },
      [](RunConfig& c) { c.checkpoint.interval = 100; }, [](RunConfig& c) { c.checkpoint.keep_last = 1; },
      [](RunConfig& c) { c.metrics.tensorboard = false; }, [](RunConfig& c) { c.metrics.peak_tflops = 312; },
      [](RunConfig& c) { c.metrics.alert_imbalance = 0.5; }, [](RunConfig& c) { c.metrics.alert_comm_wait = 0.1; },
      [](RunConfig& c) { c.metrics.alert_grad_sync_ms = 2.5; }, [](RunConfig& c) { c.metrics.phase_times = true; },
      [](RunConfig& c) { c.training.stop_at = 5; }, [](RunConfig& c) { c.training.nan_max_skips = 0; },
      [](RunConfig& c) { c.training.nan_lr_factor = 0.25; }, [](RunConfig& c) { c.training.loss_spike_factor = 0; },
      [](RunConfig& c) { c.training.memory_limit_mb = 64; }, [](RunConfig& c) { c.checkpoint.async = true; },
      [](RunConfig& c) { c.training.recompute_layers = -1; }, [](RunConfig& c) { c.training.cuda_graphs = true; },
      [](RunConfig& c) { c.training.recompute_experts = ExpertRecompute::Swiglu; },
      [](RunConfig& c) { c.training.recompute_experts_layers = 3; },
      [](RunConfig& c) { c.training.expert_grad_dtype = GradDtype::Bf16; },
      [](RunConfig& c) { c.training.deterministic_attention = DeterministicAttention::Ordered; },
      [](RunConfig& c) { c.parallel.expert_parallel = 2; }, [](RunConfig& c) { c.parallel.all_to_all = AllToAllKind::Hierarchical; },
      [](RunConfig& c) { c.parallel.bucket_mb = 0.5; }, [](RunConfig& c) { c.parallel.a2a_chunks = 3; },
      [](RunConfig& c) { c.parallel.rebalance_interval = 50; }, [](RunConfig& c) { c.parallel.comm_sms = 24; },
      [](RunConfig& c) { c.parallel.grad_reduce_dtype = ReduceDtype::Bf16; },
      [](RunConfig& c) { c.parallel.zero = 0; },
      [](RunConfig& c) { c.parallel.rebalance_max_experts = 8; },
      [](RunConfig& c) { c.parallel.expert_parallel = 2; c.parallel.split_experts = true; },
      [](RunConfig& c) { c.model.moe.route_groups = 4; c.model.moe.route_top_groups = 2; },
      [](RunConfig& c) { c.model.moe.merge_interval = 50; c.model.moe.merge_similarity = -0.25; },
      [](RunConfig& c) { c.model.moe.merge_pairs = 2; c.model.moe.merge_noise = 0.125; },
      [](RunConfig& c) { c.parallel.backend = CommBackend::Mpi; },
      [](RunConfig& c) { c.metrics.dir = "runs/t"; c.metrics.trace = true; },
      [](RunConfig& c) { c.model.moe.route_cache = true; c.model.moe.route_cache_predict = 4; },
      [](RunConfig& c) { c.model.moe.route_cache = true; c.parallel.expert_parallel = 2; c.model.moe.speculative_dispatch = true; },
      [](RunConfig& c) { c.model.moe.route_cache_keys = 1000; },
      [](RunConfig& c) { c.training.bf16_gemm_backend = GemmBackend::Cutlass; },
      [](RunConfig& c) { c.training.interleave_gate_up = false; },
      [](RunConfig& c) { c.training.swiglu_in_gemm = false; },
      [](RunConfig& c) {
        c.training.deterministic_attention = DeterministicAttention::Workspace;  // chunks do not take ordered
        c.training.attention_query_chunks = 4;
      },
      // Last: fp8 needs the GPU and dims of whole 128-blocks (over the changes above in `all`).
      [](RunConfig& c) {
        c.training.precision = TrainingPrecision::Fp8;
        c.training.device = TrainingDevice::Cuda;
        c.model.moe.expert_hidden = 128;
        c.training.fp8_weight_cache = false;
        c.training.fp8_weight_gradients = true;
        c.training.fp8_weight_gradient_scales = Fp8ColumnScales::Block128x128;
      },
  };
  const std::string default_text = config_to_toml(RunConfig{});
  for (size_t i = 0; i < changes.size(); ++i) {
    SCOPED_TRACE("change " + std::to_string(i));
    RunConfig changed;
    changes[i](changed);
    ASSERT_NO_THROW(validate_config(changed));
    std::string text = config_to_toml(changed);
    EXPECT_NE(text, default_text) << "the changed field is not written";
    RunConfig parsed = parse_config(text, "written");
    EXPECT_EQ(config_to_toml(parsed), text) << "the changed field does not read back";
  }
  RunConfig all;
  for (const auto& change : changes) change(all);
  ASSERT_NO_THROW(validate_config(all));
  RunConfig parsed = parse_config(config_to_toml(all), "written");
  EXPECT_EQ(parsed.data.dir, all.data.dir);
  EXPECT_EQ(parsed.model.init_std, all.model.init_std);  // bit-exact double
  EXPECT_EQ(parsed.training.seed, all.training.seed);
  EXPECT_EQ(config_to_toml(parsed), config_to_toml(all));
  // A tripwire: a new field must be added to config/run_config.cpp's key list, docs/CONFIG.md and
  // the list above before these sizes are updated.
  EXPECT_EQ(sizeof(ModelConfig), 296u);  // moe.speculative_dispatch (a bool) sits in route_cache's padding
  EXPECT_EQ(sizeof(TrainingConfig), 184u);
  EXPECT_EQ(sizeof(OptimizerConfig), 40u);
  EXPECT_EQ(sizeof(LrConfig), 24u);
  EXPECT_EQ(sizeof(DataConfig), 208u);
  EXPECT_EQ(sizeof(MetricsConfig), 88u);
  EXPECT_EQ(sizeof(CheckpointConfig), 56u);
  EXPECT_EQ(sizeof(ParallelConfig), 80u);
}

TEST(Config, DocsDescribeEveryKey) {
  std::string doc = read_text(source_dir() / "docs/CONFIG.md");
  std::vector<std::string> keys = written_keys(RunConfig{});
  ASSERT_GT(keys.size(), 40u);
  for (const auto& key : keys) EXPECT_NE(doc.find("| `" + key + "` |"), std::string::npos) << key << " not in docs/CONFIG.md";
  // And the docs describe no key that does not exist.
  std::set<std::string> known(keys.begin(), keys.end());
  std::regex row(R"(\n\| `([a-z_]+\.[a-z_0-9]+)` \|)");
  int rows = 0;
  for (auto it = std::sregex_iterator(doc.begin(), doc.end(), row); it != std::sregex_iterator(); ++it, ++rows)
    EXPECT_TRUE(known.count((*it)[1].str())) << (*it)[1].str() << " is documented but not a key";
  EXPECT_EQ(rows, static_cast<int>(keys.size()));
}

}  // namespace
}  // namespace moe
