// The step simulator (train/step_simulator.h) against hand-computed arithmetic: expected
// rows under uniform and node-first routing, alpha-beta times, flat against hierarchical
// message counts and bytes, ring collective shares, the overlap max(), ZeRO's bytes, the
// parameter split against the model's own parameter list, and a measured profile giving
// back its own step; the input files (train/hardware_description.h): bad hardware
// descriptions and profiles refused with one line naming the key.
#include "train/step_simulator.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>

#include "core/error.h"
#include "expect_error.h"
#include "model/transformer.h"
#include "train/hardware_description.h"

namespace moe {
namespace {

std::filesystem::path source_dir() {
  if (const char* dir = std::getenv("MOE_SOURCE_DIR"); dir && *dir) return dir;
  return MOE_TEST_SOURCE_DIR;
}

// Round numbers: 100 GB/s inside a node, 4 NICs of 80 Gb/s (10 GB/s each) for 4 GPUs per
// node (10 GB/s per GPU), no latency unless a test sets it.
HardwareDescription round_hardware() {
  HardwareDescription hw;
  hw.name = "round";
  hw.gpus_per_node = 4;
  hw.peak_tflops = 1000;
  hw.hbm_tb_s = 1;
  hw.matmul_efficiency = 0.5;
  hw.memory_efficiency = 0.5;
  hw.intra_bandwidth_gb_s = 100;
  hw.intra_efficiency = 1;
  hw.nics_per_node = 4;
  hw.nic_gbit_s = 80;
  hw.inter_efficiency = 1;
  return hw;
}

RunConfig small_config() {
  RunConfig c;
  ModelConfig& m = c.model;
  m.vocab_size = 1000;
  m.dim = 256;
  m.n_layers = 4;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.seq_len = 128;
  m.moe.n_experts = 16;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 512;
  c.training.micro_batch = 2;
  c.parallel.zero = 0;
  c.parallel.bucket_mb = 0;  // one piece per stage
  return c;
}

TEST(StepSimulator, ProbabilityHitByHand) {
  EXPECT_NEAR(probability_hit(8, 4, 2), 1.0 - 6.0 / 28.0, 1e-12);  // C(4,2)/C(8,2)
  EXPECT_NEAR(probability_hit(128, 1, 2), 2.0 / 128.0, 1e-12);
  EXPECT_NEAR(probability_hit(8, 8, 1), 1.0, 1e-12);
  EXPECT_NEAR(probability_hit(8, 0, 2), 0.0, 1e-12);
}

TEST(StepSimulator, ExchangeRowsUniformRouting) {
  // top-2 of 8 over 2 GPUs: 1.57 rows per token with its own (BENCHMARKS.md), 0.786 leave.
  ExchangeRows two = exchange_rows(8, 2, 2, 2, 0, 0);
  EXPECT_NEAR(two.same_node, 22.0 / 28.0, 1e-12);
  EXPECT_EQ(two.other_nodes, 0.0);
  // 4 ranks of 2 experts in 2 nodes of 2: a rank is hit with 1 - C(6,2)/C(8,2) = 13/28.
  ExchangeRows four = exchange_rows(8, 2, 4, 2, 0, 0);
  EXPECT_NEAR(four.same_node, 13.0 / 28.0, 1e-12);
  EXPECT_NEAR(four.other_nodes, 2 * 13.0 / 28.0, 1e-12);
  EXPECT_NEAR(four.node_distinct, 1.0 - 6.0 / 28.0, 1e-12);  // the other node's 4 experts
  EXPECT_EQ(exchange_rows(8, 2, 1, 1, 0, 0).same_node, 0.0);
}

TEST(StepSimulator, NodeFirstGroupsBoundTheNodesNotTheRows) {
  // 2 groups = 2 nodes, 1 group per token: a rank's group is chosen half the time, and
  // then it is hit with 1 - C(2,2)/C(4,2) = 5/6.
  ExchangeRows grouped = exchange_rows(8, 2, 4, 2, 2, 1);
  EXPECT_NEAR(grouped.same_node, 0.5 * 5.0 / 6.0, 1e-12);
  EXPECT_NEAR(grouped.other_nodes, 2 * 0.5 * 5.0 / 6.0, 1e-12);
  EXPECT_NEAR(grouped.node_distinct, 0.5, 1e-12);  // the other node exactly when its group is chosen
  // 128 experts top-2 over 16 nodes of 8: the rows leaving the node are the same with and
  // without 16 groups (any group equally likely), the distinct nodes at most 1 with them.
  ExchangeRows uniform = exchange_rows(128, 2, 128, 8, 0, 0), nodes = exchange_rows(128, 2, 128, 8, 16, 1);
  EXPECT_NEAR(uniform.other_nodes, 120 * 2.0 / 128.0, 1e-12);
  EXPECT_NEAR(nodes.other_nodes, uniform.other_nodes, 1e-12);
  EXPECT_NEAR(nodes.node_distinct, 15.0 / 16.0, 1e-12);
  EXPECT_GT(uniform.node_distinct, 1.8);
}

TEST(StepSimulator, AlphaBeta) {
  EXPECT_NEAR(alpha_beta_ms(1e9, 3, 2, 1e11), 10.0 + 0.006, 1e-12);
  EXPECT_EQ(alpha_beta_ms(0, 0, 5, 1e9), 0.0);
}

TEST(StepSimulator, FlatAndHierarchicalMessagesAndBytes) {
  HardwareDescription hw = round_hardware();
  hw.intra_latency_us = 1;
  hw.inter_latency_us = 10;
  // EP 16 in 4 nodes of 4, one expert per rank, top-1: each other rank gets 1/16 of the tokens.
  const ExchangeRows rows = exchange_rows(16, 1, 16, 4, 0, 0);
  EXPECT_NEAR(rows.same_node, 3.0 / 16.0, 1e-12);
  EXPECT_NEAR(rows.other_nodes, 12.0 / 16.0, 1e-12);
  const double tokens = 1600, row = 1000;
  const ExchangeTime flat = exchange_time(AllToAllKind::Flat, rows, tokens, row, 16, 4, hw, {});
  EXPECT_EQ(flat.intra_messages, 3);
  EXPECT_EQ(flat.inter_messages, 12);
  EXPECT_NEAR(flat.intra_bytes, 300 * row, 1e-6);
  EXPECT_NEAR(flat.inter_bytes, 1200 * row, 1e-6);
  // NIC share 4 x 10 GB/s / 4 GPUs = 10 GB/s: 1.2 MB -> 0.12 ms, + 12 x 10 us.
  EXPECT_NEAR(flat.ms, std::max(0.003 + 0.3e6 / 100e9 * 1e3, 0.12 + 0.12), 1e-12);
  const ExchangeTime hier = exchange_time(AllToAllKind::Hierarchical, rows, tokens, row, 16, 4, hw, {});
  EXPECT_EQ(hier.intra_messages, 3);
  EXPECT_EQ(hier.inter_messages, 3);
  // Stage 1 moves the rows for the 12 ranks of another local index (on every node).
  EXPECT_NEAR(hier.intra_bytes, 1200 * row, 1e-6);
  EXPECT_NEAR(hier.inter_bytes, flat.inter_bytes, 1e-6);
  EXPECT_NEAR(hier.ms, 0.003 + 1.2e6 / 100e9 * 1e3 + 0.03 + 0.12, 1e-12);
  // A measured NVLink rate replaces the description's inside the node.
  MeasuredCollectives measured;
  measured.intra_all_to_all_bytes_per_s = 50e9;
  EXPECT_NEAR(exchange_time(AllToAllKind::Hierarchical, rows, tokens, row, 16, 4, hw, measured).ms,
              0.003 + 1.2e6 / 50e9 * 1e3 + 0.03 + 0.12, 1e-12);
  // One node: hierarchical is flat.
  const ExchangeRows one_node = exchange_rows(16, 1, 4, 4, 0, 0);
  EXPECT_EQ(exchange_time(AllToAllKind::Hierarchical, one_node, tokens, row, 4, 4, hw, {}).ms,
            exchange_time(AllToAllKind::Flat, one_node, tokens, row, 4, 4, hw, {}).ms);
}

TEST(StepSimulator, RingCollectives) {
  const HardwareDescription hw = round_hardware();
  // 4 ranks in one node: all-reduce 2 x 3/4 x 1 GB at 100 GB/s = 15 ms; reduce-scatter half.
  EXPECT_NEAR(collective_ms(Collective::AllReduce, 1e9, 4, 4, 1, hw, 4), 15.0, 1e-9);
  EXPECT_NEAR(collective_ms(Collective::ReduceScatter, 1e9, 4, 4, 1, hw, 4), 7.5, 1e-9);
  EXPECT_NEAR(collective_ms(Collective::AllGather, 1e9, 4, 4, 1, hw, 4), 7.5, 1e-9);
  // 8 ranks over 2 nodes: the NIC share (10 GB/s) decides.
  EXPECT_NEAR(collective_ms(Collective::AllReduce, 1e9, 8, 4, 1, hw, 4), 2 * 7.0 / 8.0 * 100.0, 1e-9);
  EXPECT_EQ(collective_ms(Collective::AllReduce, 1e9, 1, 1, 1, hw, 4), 0.0);
  // Latency: 2 x (log2(4 nodes) x 10 us + 3 x 1 us) per call.
  HardwareDescription slow = hw;
  slow.intra_latency_us = 1;
  slow.inter_latency_us = 10;
  EXPECT_NEAR(collective_ms(Collective::AllReduce, 1e9, 16, 4, 5, slow, 4) -
                  collective_ms(Collective::AllReduce, 1e9, 16, 4, 0, slow, 4),
              5 * 2 * (2 * 10 + 3) * 1e-3, 1e-9);
}

TEST(StepSimulator, OverlapShowsWhatOutlastsTheWindow) {
  EXPECT_EQ(exposed_ms(10, 8, 1), 2);
  EXPECT_EQ(exposed_ms(10, 20, 1), 1);   // the last piece starts after the window
  EXPECT_EQ(exposed_ms(0.5, 20, 1), 0.5);
  EXPECT_EQ(exposed_ms(0, 20, 1), 0);
  EXPECT_EQ(overlapped_ms(10, 2), 8);
}

TEST(StepSimulator, ParameterSplitIsTheModelsParameterList) {
  for (bool tied : {false, true})
    for (int64_t dense_layers : {0, 1})
      for (int64_t shared : {0, 1}) {
        RunConfig c = small_config();
        c.model.tie_embeddings = tied;
        c.model.first_dense_layers = dense_layers;
        c.model.moe.n_shared_experts = shared;
        const ParameterSplit p = split_parameters(c.model);
        EXPECT_EQ(p.dense + p.expert, Transformer<float>::parameter_specs(c.model).total_numel())
            << tied << dense_layers << shared;
        EXPECT_EQ(p.expert, (4 - dense_layers) * 16 * 3 * 256 * 512);
      }
}

TEST(StepSimulator, WorkByHand) {
  const RunConfig c = small_config();
  const StepWork w = micro_batch_work(c.model, 256);
  // 3 x (forward): experts 4 layers x 2 x 256 tokens x 2 experts x 3 x 256 x 512, router 2 x 256 x 256 x 16.
  EXPECT_DOUBLE_EQ(w.expert_flops, 3.0 * 4 * (2.0 * 256 * 2 * 3 * 256 * 512 + 2.0 * 256 * 256 * 16));
  // kv width 2 x 64: projections 2 x 256 x 256 x (512 + 256), scores 12 x 256 x 128 per token-layer.
  EXPECT_DOUBLE_EQ(w.attention_flops, 3.0 * 4 * 2 * 256 * 256 * (512 + 256) + 12.0 * 4 * 256 * 128 * 256);
  EXPECT_DOUBLE_EQ(w.lm_head_flops, 3.0 * 2 * 256 * 256 * 1000);
  EXPECT_DOUBLE_EQ(w.memory_elements, 256.0 * 256 * (4 + 4 * 2));
  EXPECT_EQ(optimizer_bytes_per_parameter(2), 22.0);
  EXPECT_EQ(optimizer_bytes_per_parameter(4), 30.0);
}

TEST(StepSimulator, AProfileGivesBackItsOwnStep) {
  const ComputeProfile profile =
      load_compute_profile((source_dir() / "configs/hardware/profiles/h200-mixtral-mini-8ebd42c.json").string());
  HardwareDescription hw = round_hardware();
  hw.peak_tflops = profile.peak_tflops;
  hw.hbm_tb_s = profile.hbm_tb_s;
  RunConfig c = profile.config;
  c.parallel.zero = 0;
  SimLayout one;
  one.gpus = 1;
  one.gpus_per_node = 1;
  const StepPrediction p = simulate_step(c, one, hw, rates_from_profile(profile, hw));
  double sum = 0;
  for (const auto& [name, ms] : profile.phase_ms) sum += ms;
  EXPECT_NEAR(p.step, sum, 1e-9);
  EXPECT_NEAR(p.attention, profile.phase_ms.at("attention"), 1e-9);
  EXPECT_NEAR(p.optimizer, profile.phase_ms.at("optimizer"), 1e-9);
  EXPECT_NEAR(p.efficiency, 1.0, 1e-12);
  // Imbalance and exchanges count against it: EP 2 on 2 GPUs with the busiest rank at 1.5x.
  SimLayout two = one;
  two.gpus = two.gpus_per_node = two.expert_parallel = 2;
  two.expert_imbalance = 0.5;
  const StepPrediction q = simulate_step(c, two, hw, rates_from_profile(profile, hw));
  EXPECT_NEAR(q.experts, 1.5 * p.experts, 1e-9);
  EXPECT_NEAR(q.efficiency, (q.compute - q.experts / 3 + q.optimizer) / q.step, 1e-12);
  // Half the peaks: GEMM phases and memory phases twice as long.
  HardwareDescription half = hw;
  half.peak_tflops /= 2;
  half.hbm_tb_s /= 2;
  EXPECT_NEAR(simulate_step(c, one, half, rates_from_profile(profile, half)).step, 2 * sum, 1e-9);
}

TEST(StepSimulator, ZeroLevelsBytesAndOptimizer) {
  const HardwareDescription hw = round_hardware();
  const ComputeRates rates = rates_from_hardware(hw);
  RunConfig c = small_config();
  SimLayout l;
  l.gpus = 4;
  l.gpus_per_node = 4;
  const ParameterSplit params = split_parameters(c.model);
  l.zero = 0;
  const StepPrediction z0 = simulate_step(c, l, hw, rates);
  EXPECT_DOUBLE_EQ(z0.grad_bytes, 4.0 * (params.dense + params.expert));
  EXPECT_NEAR(z0.grad_sync, 2 * 0.75 * z0.grad_bytes / 100e9 * 1e3, 1e-9);  // all-reduce
  EXPECT_EQ(z0.weight_gather, 0);
  l.zero = 1;
  const StepPrediction z1 = simulate_step(c, l, hw, rates);
  EXPECT_NEAR(z1.grad_sync, z0.grad_sync / 2, 1e-9);  // reduce-scatter
  EXPECT_NEAR(z1.optimizer, z0.optimizer / 4, 1e-9);
  EXPECT_NEAR(z1.weight_gather, 0.75 * 2.0 * (params.dense + params.expert) / 100e9 * 1e3, 1e-9);  // bf16 all-gather
  l.zero = 3;
  l.micro_batches = 2;
  const StepPrediction z3 = simulate_step(c, l, hw, rates);
  EXPECT_NEAR(z3.weight_gather, 2 * 2 * z1.weight_gather, 1e-9);  // forward and backward, each micro-batch
  // Expert parallel 4: the experts' gradients stay on their one holder.
  l.zero = 0;
  l.micro_batches = 1;
  l.expert_parallel = 4;
  const StepPrediction ep = simulate_step(c, l, hw, rates);
  EXPECT_DOUBLE_EQ(ep.grad_bytes, 4.0 * params.dense);
  EXPECT_GT(ep.a2a, 0);
  // 2 exchanges forward + 2 backward per MoE layer.
  EXPECT_NEAR(ep.a2a, 4 * 4 * ep.exchange.ms, 1e-12);
}

// The logged per-expert imbalance to the busiest rank's, by hand: 8 experts top-2 with one
// expert taking every token (imbalance 3: half the assignments), the other half spread over
// 7; EP 2 holds it and 3 others: 1/2 + 3/14 = 5/7 of the rows against 1/2.
TEST(StepSimulator, RankImbalanceFromTheLoggedExpertImbalance) {
  EXPECT_NEAR(rank_imbalance_of_expert_imbalance(3.0, 8, 2, 2), 2.0 * (0.5 + 3.0 * 0.5 / 7.0) - 1.0, 1e-12);
  EXPECT_NEAR(rank_imbalance_of_expert_imbalance(3.0, 8, 2, 4), 4.0 * (0.5 + 0.5 / 7.0) - 1.0, 1e-12);
  EXPECT_NEAR(rank_imbalance_of_expert_imbalance(3.0, 8, 2, 8), 3.0, 1e-12);  // one expert per rank: the same
  EXPECT_NEAR(rank_imbalance_of_expert_imbalance(0.0, 64, 8, 8), 0.0, 1e-12);   // even stays even
  EXPECT_EQ(rank_imbalance_of_expert_imbalance(3.0, 8, 2, 1), 0.0);            // one rank holds everything
  test::expect_one_line_error<ConfigError>([] { rank_imbalance_of_expert_imbalance(3.5, 8, 2, 2); },
                                           {"--expert-load-imbalance 3.5", "between 0 and 3"});
  test::expect_one_line_error<ConfigError>([] { rank_imbalance_of_expert_imbalance(1.0, 8, 2, 3); },
                                           {"parallel.expert_parallel 3 must divide moe.n_experts (8)"});
}

// Logged counts, by hand: 4 experts over 2 ranks. Row 1: ranks get 6 and 2 of 8 (1.5 x the
// mean); row 2: 3 and 3 (even); an empty row is skipped: (1.5 + 1) / 2 - 1 = 0.25.
TEST(StepSimulator, RankImbalanceFromLoggedCounts) {
  const std::vector<std::vector<int64_t>> rows = {{5, 1, 2, 0}, {1, 2, 3, 0}, {0, 0, 0, 0}};
  EXPECT_NEAR(rank_imbalance_of_expert_loads(rows, 2), 0.25, 1e-12);
  EXPECT_NEAR(rank_imbalance_of_expert_loads(rows, 1), 0.0, 1e-12);
  // One rank per expert: the per-expert max / mean: (5/2 + 3/1.5) / 2 - 1.
  EXPECT_NEAR(rank_imbalance_of_expert_loads(rows, 4), (2.5 + 2.0) / 2 - 1, 1e-12);
  test::expect_one_line_error<ConfigError>([&] { rank_imbalance_of_expert_loads(rows, 3); },
                                           {"parallel.expert_parallel 3 must divide the 4 experts logged"});
  test::expect_one_line_error<ConfigError>([] { rank_imbalance_of_expert_loads({{0, 0}}, 2); },
                                           {"no layer with assignments"});
}

// metrics.jsonl read back: step records' layers only (run and val records skipped), one row
// per layer per step; bad lines refused with one line naming the file and line.
TEST(ExpertLoads, ReadsTheStepRecordsOfAMetricsFile) {
  const std::string good =
      "{\"type\": \"run\", \"n_experts\": 4}\n"
      "{\"type\": \"step\", \"step\": 1, \"layers\": [{\"tokens_per_expert\": [5, 1, 2, 0]}, "
      "{\"tokens_per_expert\": [1, 2, 3, 0]}]}\n"
      "{\"type\": \"val\", \"loss\": 3.0}\n\n"
      "{\"type\": \"step\", \"step\": 2, \"layers\": [{\"tokens_per_expert\": [2, 2, 2, 2]}]}\n";
  const ExpertLoads loads = parse_expert_loads(good, "m.jsonl");
  EXPECT_EQ(loads.n_experts, 4);
  ASSERT_EQ(loads.tokens_RE.size(), 3u);
  EXPECT_EQ(loads.tokens_RE[2], (std::vector<int64_t>{2, 2, 2, 2}));
  test::expect_one_line_error<ConfigError>([] { parse_expert_loads("{\"type\": \"run\"}\n", "m.jsonl"); },
                                           {"expert loads m.jsonl: no step record"});
  test::expect_one_line_error<ConfigError>([] { parse_expert_loads("{\"type\": \"step\"\n", "m.jsonl"); },
                                           {"expert loads m.jsonl: line 1 is not JSON"});
  test::expect_one_line_error<ConfigError>(
      [] {
        parse_expert_loads("{\"type\": \"step\", \"layers\": [{\"tokens_per_expert\": [1, 2]}]}\n"
                           "{\"type\": \"step\", \"layers\": [{\"tokens_per_expert\": [1, 2, 3]}]}\n",
                           "m.jsonl");
      },
      {"line 2: 3 experts where earlier lines have 2"});
  test::expect_one_line_error<ConfigError>(
      [] { parse_expert_loads("{\"type\": \"step\", \"layers\": [{\"tokens_per_expert\": [1, -2]}]}", "m.jsonl"); },
      {"line 1: tokens_per_expert holds -2, not a count"});
}

TEST(StepSimulator, ImpossibleLayoutsAreOneLine) {
  const HardwareDescription hw = round_hardware();
  const ComputeRates rates = rates_from_hardware(hw);
  const RunConfig c = small_config();
  auto run = [&](SimLayout l) { return [=] { simulate_step(c, l, hw, rates); }; };
  SimLayout l;
  l.gpus = 6;
  l.gpus_per_node = 4;
  test::expect_one_line_error<ConfigError>(run(l), {"--gpus 6 is not a multiple of --gpus-per-node 4"});
  l.gpus = 8;
  l.gpus_per_node = 8;
  test::expect_one_line_error<ConfigError>(run(l), {"--gpus-per-node 8", "gpus_per_node (4)"});
  l.gpus_per_node = 4;
  l.expert_parallel = 3;
  test::expect_one_line_error<ConfigError>(run(l), {"parallel.expert_parallel 3 must divide"});
}

// A valid description, edited line by line into invalid ones.
const char* kGood = R"(name = "t"
gpus_per_node = 8
[compute]
peak_tflops = 989
hbm_tb_s = 4.8
matmul_efficiency = 0.7
memory_efficiency = 0.7
overlap_slowdown = 0.5
[intra_node]
bandwidth_gb_s = 450
efficiency = 0.6
latency_us = 3
[inter_node]
nics_per_node = 8
nic_gbit_s = 400
efficiency = 0.8
latency_us = 5
)";

std::string replaced(const std::string& from, const std::string& to) {
  std::string text = kGood;
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return text.replace(at, from.size(), to);
}

TEST(HardwareDescription, ParsesAndComputesRates) {
  const HardwareDescription hw = parse_hardware_description(kGood, "t.toml");
  EXPECT_EQ(hw.gpus_per_node, 8);
  EXPECT_DOUBLE_EQ(hw.intra_bytes_per_s(), 450e9 * 0.6);
  EXPECT_DOUBLE_EQ(hw.nic_bytes_per_s_per_gpu(8), 8 * 50e9 * 0.8 / 8);
  for (const char* file : {"h200-8x400g.toml", "mi250x-4x200g-ib.toml"})
    EXPECT_NO_THROW(load_hardware_description((source_dir() / "configs/hardware" / file).string())) << file;
}

TEST(HardwareDescription, BadValuesAreOneLineNamingTheKey) {
  auto refuse = [](const std::string& text, std::vector<std::string> fragments) {
    fragments.insert(fragments.begin(), "hardware t.toml");
    test::expect_one_line_error<ConfigError>([&] { parse_hardware_description(text, "t.toml"); }, fragments);
  };
  refuse(replaced("peak_tflops = 989\n", ""), {"compute.peak_tflops is missing"});
  refuse(replaced("peak_tflops = 989", "peak_tflops = -1"), {"compute.peak_tflops = -1 is outside (0"});
  refuse(replaced("matmul_efficiency = 0.7", "matmul_efficiency = 1.5"), {"compute.matmul_efficiency = 1.5"});
  refuse(replaced("efficiency = 0.8", "efficiency = 0"), {"inter_node.efficiency = 0 is outside"});
  refuse(replaced("nics_per_node = 8", "nics_per_node = 2.5"), {"inter_node.nics_per_node must be an integer"});
  refuse(replaced("nic_gbit_s = 400", "nic_gbit_s = \"fast\""), {"inter_node.nic_gbit_s must be a number"});
  refuse(replaced("latency_us = 3", "latency_us = 3\nlatncy_us = 4"), {"intra_node.latncy_us is not a key"});
  refuse(replaced("latency_us = 5", "latency_us = -5"), {"inter_node.latency_us = -5 is outside [0"});
  refuse(replaced("gpus_per_node = 8", "gpus_per_node = 0"), {"gpus_per_node must be an integer in [1, 1024]"});
  refuse(replaced("name = \"t\"", "name = \"\""), {"name must be a non-empty string"});
  refuse(replaced("[inter_node]", "[internode]"), {"internode is not a key"});
  refuse(replaced("bandwidth_gb_s = 450", "bandwidth_gb_s = [450"), {"line 11"});
}

TEST(ComputeProfile, RoundTripAndRefusals) {
  ComputeProfile p;
  p.source = "test";
  p.peak_tflops = 989;
  p.hbm_tb_s = 4.8;
  p.config = small_config();
  p.config.optimizer.state_dtype = MomentDtype::Bf16;
  p.phase_ms = {{"attention", 1.5}, {"experts", 2.25}, {"optimizer", 0.5}};
  const ComputeProfile back = parse_compute_profile(compute_profile_json(p), "p.json");
  EXPECT_EQ(back.phase_ms, p.phase_ms);
  for (const MomentDtype moments : {MomentDtype::Fp32, MomentDtype::Fp8}) {  // 4 and 1.0625 bytes a moment
    ComputeProfile q = p;
    q.config.optimizer.state_dtype = moments;
    EXPECT_EQ(parse_compute_profile(compute_profile_json(q), "p.json").config.optimizer.state_dtype, moments);
  }
  EXPECT_EQ(back.config.model.dim, 256);
  EXPECT_EQ(back.config.model.moe.n_experts, 16);
  EXPECT_EQ(back.config.training.micro_batch, 2);
  EXPECT_EQ(back.config.optimizer.state_dtype, MomentDtype::Bf16);
  EXPECT_EQ(split_parameters(back.config.model).dense, split_parameters(p.config.model).dense);
  test::expect_one_line_error<ConfigError>([] { parse_compute_profile("{", "p.json"); }, {"p.json: not JSON"});
  test::expect_one_line_error<ConfigError>([] { parse_compute_profile("{\"format\": \"x\"}", "p.json"); },
                                           {"\"format\" must be \"moe-compute-profile-1\""});
  std::string text = compute_profile_json(p);
  text.replace(text.find("\"dim\": 256"), 10, "\"dim\": -2");
  test::expect_one_line_error<ConfigError>([&] { parse_compute_profile(text, "p.json"); }, {"\"dim\" = -2"});
}

TEST(MeasuredCollectives, ReadsTheFlatRateInsideOneNode) {
  dist::AllToAllBenchResult flat, hier;
  flat.kind = AllToAllKind::Flat;
  flat.dispatch_gb_per_s = 280;
  flat.combine_gb_per_s = 290;
  flat.ranks = hier.ranks = 4;
  flat.nodes = hier.nodes = 1;
  hier.kind = AllToAllKind::Hierarchical;
  hier.dispatch_gb_per_s = hier.combine_gb_per_s = 100;
  const std::string text = all_to_all_bench_json({flat, hier}, "nccl");
  EXPECT_DOUBLE_EQ(parse_measured_collectives(text, "a.json").intra_all_to_all_bytes_per_s, 285e9);
  flat.nodes = hier.nodes = 2;  // across nodes: not the NVLink rate
  EXPECT_EQ(parse_measured_collectives(all_to_all_bench_json({flat, hier}, "nccl"), "a.json").intra_all_to_all_bytes_per_s,
            0);
  test::expect_one_line_error<ConfigError>([] { parse_measured_collectives("[]", "a.json"); },
                                           {"a.json", "moe-a2a-bench-1"});
}

// An all-reduce sweep round-trips through its JSON into the simulator's alpha-beta: the
// smallest size's time as the latency, the largest size's bus bandwidth as the rate, which
// then price the reductions inside one node (not across nodes); bad sweeps are one line.
TEST(MeasuredCollectives, AllReduceSweepGivesTheReductionsAlphaBeta) {
  dist::AllReduceSweep sweep;
  sweep.ranks = 4;
  sweep.nodes = 1;
  for (const auto& [bytes, ms, busbw] : {std::tuple{4096.0, 0.02, 0.3}, {1e6, 0.03, 50.0}, {1e9, 7.5, 200.0}}) {
    dist::AllReduceBenchResult r;
    r.bytes = bytes;
    r.ms = ms;
    r.bus_gb_per_s = busbw;
    r.alg_gb_per_s = busbw * 4 / 6;
    r.sums_ok = true;
    sweep.results.push_back(r);
  }
  const std::string text = all_reduce_bench_json(sweep, "nccl");
  const MeasuredCollectives m = parse_measured_collectives(text, "ar.json");
  EXPECT_DOUBLE_EQ(m.intra_all_reduce_bus_bytes_per_s, 200e9);
  EXPECT_DOUBLE_EQ(m.intra_all_reduce_latency_us, 20.0);
  EXPECT_EQ(m.intra_all_to_all_bytes_per_s, 0);
  const HardwareDescription hw = round_hardware();
  // 4 ranks, one node: 2 x 3/4 x 1 GB at 200 GB/s = 7.5 ms, + 3 calls x 20 us; reduce-scatter
  // half the bytes and half the latency.
  EXPECT_NEAR(collective_ms(Collective::AllReduce, 1e9, 4, 4, 3, hw, 4, m), 7.5 + 0.06, 1e-9);
  EXPECT_NEAR(collective_ms(Collective::ReduceScatter, 1e9, 4, 4, 3, hw, 4, m), 3.75 + 0.03, 1e-9);
  // Across nodes the hardware description's rates stay.
  EXPECT_EQ(collective_ms(Collective::AllReduce, 1e9, 8, 4, 1, hw, 4, m), collective_ms(Collective::AllReduce, 1e9, 8, 4, 1, hw, 4));
  sweep.results[1].sums_ok = false;
  test::expect_one_line_error<ConfigError>(
      [&] { parse_measured_collectives(all_reduce_bench_json(sweep, "nccl"), "ar.json"); }, {"ar.json", "sums_ok"});
  sweep.results[1].sums_ok = true;
  sweep.ranks = 1;
  test::expect_one_line_error<ConfigError>(
      [&] { parse_measured_collectives(all_reduce_bench_json(sweep, "nccl"), "ar.json"); }, {"ar.json", "fewer than 2"});
  sweep.ranks = 8;
  sweep.nodes = 2;  // across nodes: nothing for the intra-node rates
  EXPECT_EQ(parse_measured_collectives(all_reduce_bench_json(sweep, "nccl"), "ar.json").intra_all_reduce_bus_bytes_per_s, 0);
}

}  // namespace
}  // namespace moe
