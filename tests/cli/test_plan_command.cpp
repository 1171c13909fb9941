// `moe plan` as users run it: the real-size configs' tables and fitting layouts, and a
// bad flag refused with one line.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "cli/moe_process.h"

namespace {

std::string config(const std::string& name) {
  const char* dir = std::getenv("MOE_SOURCE_DIR");
  return (std::filesystem::path(dir && *dir ? dir : MOE_TEST_SOURCE_DIR) / "configs" / name).string();
}

TEST(PlanCommand, Mixtral8x7bOverEightGpus) {
  const moe::test::MoeResult r = moe::test::run_moe("plan -c " + config("models/mixtral-8x7b.toml") + " --gpus 8");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"46.70 B parameters", "layout: 8 GPUs (8 per node), expert_parallel 8, zero 1",
                           "AdamW moments", "activations by layer: layers 0-31:", "the recompute set", "largest: ",
                           "layouts that fit on 8 GPUs, best first"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << " not in:\n" << r.output;
}

TEST(PlanCommand, Writeup500bOverAThousandGpusAndOverrides) {
  const moe::test::MoeResult r = moe::test::run_moe("plan -c " + config("models/writeup-500b.toml") +
                                                    " --gpus 1024 --gpus-per-node 8 --gpu-memory-gb 80 --parallel.zero=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"layout: 1024 GPUs (8 per node), expert_parallel 128, zero 3", "in 78.0 GB (80 GB less a 2 GB reserve)"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << " not in:\n" << r.output;
}

// `auto` GEMM backends plan the target's H100 / H200 boards, not this host (which may have no
// GPU): olmoe-mini's experts on DeepGEMM with gate|up interleaved, so ZeRO-3 over 8 keeps a
// rank's w1 | w3 pieces as one range (1.13 GB of bf16 weights; CUTLASS's layout 1.22).
TEST(PlanCommand, AutoBackendsPlanTheTargetsGpusNotThisHost) {
  const std::string base = "plan -c " + config("bench/olmoe-mini.toml") + " --gpus 8 --parallel.zero=3";
  const moe::test::MoeResult r = moe::test::run_moe(base);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"experts' GEMMs: bf16 deepgemm (training.bf16_gemm_backend; auto plans an H100 / H200 SXM",
                           "weights (bf16)                     1.13"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << " not in:\n" << r.output;
  const moe::test::MoeResult cutlass = moe::test::run_moe(base + " --training.bf16_gemm_backend=cutlass");
  ASSERT_EQ(cutlass.exit_code, 0) << cutlass.output;
  for (const char* line : {"experts' GEMMs: bf16 cutlass", "weights (bf16)                     1.22"})
    EXPECT_NE(cutlass.output.find(line), std::string::npos) << line << " not in:\n" << cutlass.output;
}

TEST(PlanCommand, ALayoutTheConfigCannotTakeIsOneLine) {
  moe::test::expect_one_line_error(moe::test::run_moe("plan -c " + config("models/mixtral-8x7b.toml") + " --gpus 4"), 2,
                                   {"moe: error: parallel.expert_parallel = 8 must divide", "the 4 GPUs"});
  // The default config takes its vocabulary from the tokenizer at training time.
  moe::test::expect_one_line_error(moe::test::run_moe("plan -c " + config("default.toml")), 2,
                                   {"moe: error: model.vocab_size = 0: the memory plan needs"});
}

// `moe plan --simulate` (docs/SIMULATOR.md): the write-up model over 64 H200s in nodes of 8,
// flat against hierarchical, as a table and as JSON; its inputs refused with one line.
TEST(PlanCommand, SimulateTableAndJson) {
  const std::string base = "plan --simulate -c " + config("models/writeup-500b.toml") + " --hardware " +
                           config("hardware/h200-8x400g.toml") + " --gpus 64 --gpus-per-node 8 --micro-batches 1";
  const moe::test::MoeResult table = moe::test::run_moe(base + " --compute " +
                                                        config("hardware/profiles/h200-mixtral-mini-8ebd42c.json"));
  ASSERT_EQ(table.exit_code, 0) << table.output;
  for (const char* line : {"64 GPUs in nodes of 8; expert_parallel 64 (8 nodes x 8)", "flat   hierarchical",
                           "7 + 56 messages", "7 + 7 messages", "all-to-all (not overlapped)", "communication share",
                           "weak-scaling efficiency", "tokens/s per GPU"})
    EXPECT_NE(table.output.find(line), std::string::npos) << line << " not in:\n" << table.output;
  const moe::test::MoeResult json = moe::test::run_moe(base + " --json");
  ASSERT_EQ(json.exit_code, 0) << json.output;
  for (const char* key : {"\"ep_nodes\": 8", "\"hierarchical\": {", "\"a2a_ms\":", "\"comm_share\":"})
    EXPECT_NE(json.output.find(key), std::string::npos) << key << " not in:\n" << json.output;
}

// An all-reduce sweep (`moe allreduce-bench --json`) given with --collectives prices the
// reductions inside a node: the table says so, and a faster measured rate shortens the
// data-parallel gradient sync of 8 GPUs in one node.
TEST(PlanCommand, SimulateWithAMeasuredAllReduceSweep) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "moe_plan_allreduce";
  std::filesystem::create_directories(dir);
  auto sweep = [&](const std::string& name, double busbw) {
    const std::filesystem::path path = dir / name;
    std::ofstream(path) << "{\"format\": \"moe-allreduce-bench-1\", \"backend\": \"nccl\", \"ranks\": 8, \"nodes\": 1, "
                           "\"results\": [{\"bytes\": 4096, \"ms\": 0.02, \"algbw_gb_s\": 0.2, \"busbw_gb_s\": 0.36, "
                           "\"sums_ok\": true}, {\"bytes\": 1073741824, \"ms\": 10, \"algbw_gb_s\": 107, \"busbw_gb_s\": "
                        << busbw << ", \"sums_ok\": true}]}";
    return path.string();
  };
  const std::string base = "plan --simulate -c " + config("bench/mixtral-mini.toml") + " --hardware " +
                           config("hardware/h200-8x400g.toml") + " --gpus 8 --micro-batches 1";
  const moe::test::MoeResult table = moe::test::run_moe(base + " --collectives " + sweep("slow.json", 50));
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("reductions inside a node: measured all-reduce bus bandwidth 50.0 GB/s, 20.0 us per call"),
            std::string::npos)
      << table.output;
  auto grad_sync = [&](const std::string& file) {
    const moe::test::MoeResult r = moe::test::run_moe(base + " --json --collectives " + file);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const size_t at = r.output.find("\"grad_sync_ms\": ");
    EXPECT_NE(at, std::string::npos) << r.output;
    return at == std::string::npos ? 0.0 : std::stod(r.output.substr(at + 16));
  };
  EXPECT_GT(grad_sync(sweep("slow.json", 50)), 1.5 * grad_sync(sweep("fast.json", 400)));
  std::filesystem::remove_all(dir);
}

// The logged per-expert imbalance stands in for the busiest rank's share: mixtral-mini at
// EP 4 with one expert taking every token (3.00: half the assignments) gives the busiest
// rank 1/2 + 1/14 of the rows, 2.29 x the mean, and a much slower step than even rows.
TEST(PlanCommand, SimulateFromTheLoggedExpertImbalance) {
  const std::string base = "plan --simulate -c " + config("bench/mixtral-mini.toml") + " --hardware " +
                           config("hardware/h200-8x400g.toml") + " --gpus 4 --micro-batches 1 " +
                           "--parallel.expert_parallel=4 --json";
  auto step = [&](const std::string& extra) {
    const moe::test::MoeResult r = moe::test::run_moe(base + extra);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const size_t at = r.output.find("\"step_ms\": ");
    EXPECT_NE(at, std::string::npos) << r.output;
    return at == std::string::npos ? 0.0 : std::stod(r.output.substr(at + 11));
  };
  const double derived = step(" --expert-load-imbalance 3");
  EXPECT_NEAR(derived, step(" --expert-imbalance " + std::to_string(4.0 * (0.5 + 0.5 / 7.0) - 1.0)), 1e-3);
  EXPECT_GT(derived, 1.5 * step(""));
  moe::test::expect_one_line_error(moe::test::run_moe(base + " --expert-load-imbalance 3.5"), 2,
                                   {"--expert-load-imbalance 3.5: between 0 and 3"});
  const moe::test::MoeResult both = moe::test::run_moe(base + " --expert-load-imbalance 1 --expert-imbalance 1");
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.output.find("excludes"), std::string::npos) << both.output;
}

// A run's own metrics.jsonl read back by the simulator: train a tiny MoE for 3 steps, then
// simulate it over 2 GPUs from the tokens_per_expert it logged; the table names the file and
// the busiest rank's share (at least the mean), and a model with other experts is refused.
TEST(PlanCommand, SimulateFromARunsLoggedExpertLoads) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "moe_plan_expert_loads";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "text");
  for (int i = 0; i < 12; ++i)
    std::ofstream(dir / "text" / ("doc" + std::to_string(i) + ".txt"))
        << "Document " << i << ": the quick brown fox jumps over the lazy dog. " << std::string(80, 'a' + i) << "\n";
  const std::string run_config = (dir / "tiny.toml").string();
  std::ofstream(run_config) << "[model]\ndim = 16\nn_layers = 2\nn_heads = 2\nn_kv_heads = 1\nseq_len = 32\n"
                            << "[moe]\nn_experts = 4\nexpert_hidden = 16\n"
                            << "[training]\nsteps = 3\nglobal_batch_tokens = 128\nmicro_batch = 2\nval_batches = 1\n"
                            << "threads = 1\nval_interval = 0\n"
                            << "[data]\ndir = \"" << (dir / "text").string() << "\"\nval_fraction = 0.2\n"
                            << "[metrics]\ndir = \"" << (dir / "run").string() << "\"\n";
  const moe::test::MoeResult train = moe::test::run_moe("train -c " + run_config);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const std::string metrics = (dir / "run" / "metrics.jsonl").string();
  const std::string base = "plan --simulate -c " + run_config + " --hardware " + config("hardware/h200-8x400g.toml") +
                           " --gpus 2 --micro-batches 1 --parallel.expert_parallel=2 --model.vocab_size=257";
  const moe::test::MoeResult table = moe::test::run_moe(base + " --expert-loads " + metrics);
  ASSERT_EQ(table.exit_code, 0) << table.output;
  const size_t at = table.output.find("expert rows: the busiest rank's ");
  ASSERT_NE(at, std::string::npos) << table.output;
  EXPECT_GE(std::stod(table.output.substr(at + 32)), 1.0) << table.output;
  EXPECT_NE(table.output.find("from the tokens_per_expert logged in " + metrics), std::string::npos) << table.output;
  moe::test::expect_one_line_error(moe::test::run_moe(base + " --moe.n_experts=8 --expert-loads " + metrics), 2,
                                   {"--expert-loads", "4 experts logged, the config has moe.n_experts = 8"});
  std::filesystem::remove_all(dir);
}

TEST(PlanCommand, SimulateInputsAreOneLine) {
  moe::test::expect_one_line_error(
      moe::test::run_moe("plan --simulate -c " + config("models/writeup-500b.toml") + " --gpus 64"), 2,
      {"moe: error: --simulate needs --hardware FILE"});
  moe::test::expect_one_line_error(
      moe::test::run_moe("plan -c " + config("models/writeup-500b.toml") + " --gpus 128 --json"), 2,
      {"go with --simulate"});
  moe::test::expect_one_line_error(
      moe::test::run_moe("plan --simulate -c " + config("models/writeup-500b.toml") + " --hardware " +
                         config("models/writeup-500b.toml") + " --gpus 64"),
      2, {"moe: error: hardware", "is not a key"});
  moe::test::expect_one_line_error(
      moe::test::run_moe("plan --simulate -c " + config("models/writeup-500b.toml") + " --hardware " +
                         config("hardware/h200-8x400g.toml") + " --gpus 60"),
      2, {"moe: error: --gpus 60 is not a multiple of --gpus-per-node 8"});
}

}  // namespace
