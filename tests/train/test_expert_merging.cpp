// Expert merging on the host model and in the trainer (docs/EXPERT_MERGING.md): a split
// merge of two identical experts leaves the outputs of tokens routed elsewhere unchanged,
// merge events come at the interval with their records, the state they depend on
// survives a checkpoint (resume bit-identical across a merge event), invalid settings
// are refused with one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "expect_error.h"
#include "test_resume_fixtures.h"
#include "core/rng.h"
#include "dist/tcp_ranks.h"
#include "train/checkpoint.h"
#include "train/expert_merging.h"

namespace moe {
namespace {

ModelConfig small_moe() {
  ModelConfig m;
  m.vocab_size = 32;
  m.dim = 16;
  m.n_layers = 1;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.seq_len = 8;
  m.moe.n_experts = 8;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 8;
  m.moe.router_bias = false;
  m.moe.renormalize = true;
  m.moe.merge_interval = 1;
  m.moe.merge_similarity = 0.99;
  m.moe.merge_noise = 0;
  return m;
}

// Expert 3 a copy of expert 1 (weights and router row); the merge pairs them (cosine 1),
// keeps 1 and splits the most loaded other expert into 3. Tokens whose top-2 held neither
// 3 nor that source keep their output (the renormalised weights of their two experts are
// unchanged); tokens that went to 3 change: the test can tell.
TEST(ExpertMerging, SplitMergeOfIdenticalExpertsKeepsOtherTokens) {
  const ModelConfig config = small_moe();
  Transformer<float> model(config, 5);
  OptimizerConfig oc;
  AdamW optimizer(oc, model.params());
  auto& params = model.params();
  MoELayer<float>& layer = *model.moe_layers()[0];
  const int64_t E = 8, D = config.dim;
  for (const char* name : {".experts.w1", ".experts.w3", ".experts.w2", ".router.weight"}) {
    const int id = params.find(layer.prefix() + name);
    ASSERT_GE(id, 0) << name;
    const int64_t row = params.numel(id) / E;
    std::copy_n(params.value(id) + 1 * row, row, params.value(id) + 3 * row);
  }
  const int64_t n = 64;
  std::vector<float> x(static_cast<size_t>(n * D)), before(x.size()), after(x.size());
  CounterRng rng(9, "x");
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(rng.normal(i));
  layer.forward_dropless(before.data(), x.data(), n);
  // Each token's top-2 by logit (softmax keeps the order).
  const float* router = params.value(params.find(layer.prefix() + ".router.weight"));
  std::vector<std::vector<int64_t>> top(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    std::vector<std::pair<double, int64_t>> logits;
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += double(x[t * D + d]) * router[e * D + d];
      logits.push_back({-s, e});
    }
    std::sort(logits.begin(), logits.end());
    top[t] = {logits[0].second, logits[1].second};
  }
  const std::vector<int64_t> load = {10, 30, 20, 5, 50, 1, 2, 3};  // 1 kept (30 > 5); source 4 (50)
  const auto w1_before = std::vector<float>(params.value(params.find(layer.prefix() + ".experts.w1")),
                                            params.value(params.find(layer.prefix() + ".experts.w1")) + params.numel(params.find(layer.prefix() + ".experts.w1")));
  const auto merges = merge_host_experts(model, optimizer, config.moe, {load}, {}, 1, 1);
  ASSERT_EQ(merges.size(), 1u);
  ASSERT_EQ(merges[0].size(), 1u);
  const ExpertMerge& m = merges[0][0];
  EXPECT_EQ(m.kept, 1);
  EXPECT_EQ(m.freed, 3);
  EXPECT_EQ(m.split_of, 4);
  EXPECT_NEAR(m.similarity, 1.0, 1e-12);
  EXPECT_DOUBLE_EQ(m.kept_share, 30.0 / 35.0);
  // The average of two equal experts is that expert (to rounding); 3 is now 4 (noise 0).
  const float* w1 = params.value(params.find(layer.prefix() + ".experts.w1"));
  const int64_t row = config.moe.expert_hidden * D;
  for (int64_t k = 0; k < row; ++k) {
    EXPECT_NEAR(w1[row + k], w1_before[row + k], 1e-6f * (1 + std::abs(w1_before[row + k])));
    EXPECT_EQ(w1[3 * row + k], w1_before[4 * row + k]);
  }
  layer.forward_dropless(after.data(), x.data(), n);
  int kept_tokens = 0, changed = 0;
  for (int64_t t = 0; t < n; ++t) {
    const bool elsewhere = std::find(top[t].begin(), top[t].end(), 3) == top[t].end() &&
                           std::find(top[t].begin(), top[t].end(), 4) == top[t].end();
    double diff = 0;
    for (int64_t d = 0; d < D; ++d) diff = std::max(diff, double(std::abs(after[t * D + d] - before[t * D + d])));
    if (elsewhere) {
      ++kept_tokens;
      EXPECT_LT(diff, 1e-5) << "token " << t << " routed to " << top[t][0] << "," << top[t][1];
    } else if (diff > 1e-4) {
      ++changed;
    }
  }
  EXPECT_GT(kept_tokens, 10);
  EXPECT_GT(changed, 0);
}

// The host rows: w1, w3, w2, router weight, then the router bias and balancing bias when on.
TEST(ExpertMerging, HostRowsFollowTheConfig) {
  ModelConfig config = small_moe();
  config.moe.router_bias = true;
  config.moe.bias_balancing = true;
  Transformer<float> model(config, 5);
  OptimizerConfig oc;
  AdamW optimizer(oc, model.params());
  const auto rows = host_expert_rows(model, optimizer, 0, config.moe);
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_EQ(rows[0].row, config.moe.expert_hidden * config.dim);
  EXPECT_TRUE(rows[0].similarity && rows[2].perturb);
  EXPECT_FALSE(rows[3].similarity || rows[3].perturb);
  EXPECT_EQ(rows[3].row, config.dim);
  EXPECT_EQ(rows[4].row, 1);
  EXPECT_EQ(rows[5].value, model.moe_layers()[0]->balance_bias_E().data());
  EXPECT_EQ(rows[5].m, nullptr);
  config.moe.router_bias = false;
  config.moe.bias_balancing = false;
  Transformer<float> plain(config, 5);
  AdamW plain_optimizer(oc, plain.params());
  EXPECT_EQ(host_expert_rows(plain, plain_optimizer, 0, config.moe).size(), 4u);
}

RunConfig merging_config() {
  RunConfig config = test::tiny_config();  // 4 experts, bias balancing on
  config.model.moe.merge_interval = 2;
  config.model.moe.merge_similarity = -1;  // the most similar pair at every event
  config.model.moe.merge_pairs = 1;
  return config;
}

struct MergeRun {
  std::vector<double> losses;
  std::vector<std::vector<MergeRecord>> merges;  // per step, all layers
  std::vector<float> weights;
};

MergeRun run(const RunConfig& config, const std::string& resume_from = "") {
  auto trainer = test::make_trainer(config);
  std::ostringstream log;
  if (!resume_from.empty()) trainer->resume(resume_from, log);
  MergeRun r;
  trainer->on_step = [&](const StepStats& stats) {
    r.losses.push_back(stats.loss);
    std::vector<MergeRecord> step;
    for (const LayerRouting& l : stats.layers) step.insert(step.end(), l.merges.begin(), l.merges.end());
    r.merges.push_back(step);
  };
  trainer->run(log);
  r.weights = test::all_weights(*trainer);
  return r;
}

class MergingRun : public test::TempDirTest {};

// Events after steps 2, 4, 6, 8, one pair per MoE layer each; the freed expert and its
// split source of one event are in no pair of the next.
TEST_F(MergingRun, MergesAtTheIntervalAndProtectsTheLastSplit) {
  const MergeRun r = run(merging_config());
  ASSERT_EQ(r.merges.size(), 8u);
  for (size_t s = 0; s < 8; ++s) EXPECT_EQ(r.merges[s].size(), (s + 1) % 2 == 0 ? 2u : 0u) << "step " << s + 1;
  for (size_t s = 3; s < 8; s += 2)
    for (size_t l = 0; l < 2; ++l) {
      const MergeRecord& last = r.merges[s - 2][l];
      const MergeRecord& now = r.merges[s][l];
      for (const int64_t e : {now.kept, now.freed}) {
        EXPECT_NE(e, last.freed);
        EXPECT_NE(e, last.split_of);
      }
    }
  // Merging changes training: the test can tell.
  RunConfig off = merging_config();
  off.model.moe.merge_interval = 0;
  const MergeRun plain = run(off);
  EXPECT_EQ(plain.losses[1], r.losses[1]);  // the first event comes after step 2
  EXPECT_NE(plain.losses[2], r.losses[2]);
}

// Stopped after step 3 (between the events of steps 2 and 4, the protection of step 2's
// split in the checkpoint) and resumed: the same losses, merges and weights, bit for bit.
TEST_F(MergingRun, ResumeAcrossAMergeEventIsBitIdentical) {
  RunConfig config = merging_config();
  config.checkpoint.dir = (dir_ / "whole").string();
  config.checkpoint.interval = 4;
  const MergeRun whole = run(config);
  config.checkpoint.dir = (dir_ / "split").string();
  config.checkpoint.interval = 3;
  config.training.stop_at = 3;
  const MergeRun first = run(config);
  ASSERT_EQ(first.losses.size(), 3u);
  const LoadedCheckpoint saved = read_checkpoint(dir_ / "split" / "step_00000003");
  EXPECT_NE(saved.expert_merge.find("protected"), std::string::npos) << saved.expert_merge;
  config.training.stop_at = 0;
  const MergeRun second = run(config, (dir_ / "split" / "step_00000003").string());
  ASSERT_EQ(second.losses.size(), 5u);
  std::vector<double> losses = first.losses;
  losses.insert(losses.end(), second.losses.begin(), second.losses.end());
  EXPECT_EQ(losses, whole.losses);
  EXPECT_EQ(second.weights, whole.weights);
  for (size_t s = 0; s < 5; ++s) {
    ASSERT_EQ(second.merges[s].size(), whole.merges[s + 3].size());
    for (size_t i = 0; i < second.merges[s].size(); ++i) {
      EXPECT_EQ(second.merges[s][i].kept, whole.merges[s + 3][i].kept);
      EXPECT_EQ(second.merges[s][i].freed, whole.merges[s + 3][i].freed);
      EXPECT_EQ(second.merges[s][i].split_of, whole.merges[s + 3][i].split_of);
    }
  }
}

TEST(ExpertMerging, InvalidSettingsAreRefusedWithOneLine) {
  RunConfig config = merging_config();
  config.model.moe.merge_pairs = 2;  // 6 experts needed, 4 here
  test::expect_one_line_error<ConfigError>([&] { validate_config(config); },
                                           {"moe.merge_pairs", "moe.n_experts"});
  config.model.moe.merge_pairs = 2;
  config.model.moe.merge_interval = 0;  // off: nothing to check
  EXPECT_NO_THROW(validate_config(config));
}

// The multi-rank merge (merge_sharded_experts) against the host merge: each of 2 tcp ranks
// hands in the pieces of the state it writes (host_state_pieces as replica r of 2: large
// tensors split in halves, small ones whole to one rank), rebuilds the state by a sum over
// the ranks and writes back the changed rows; every rank ends with the host merge's state,
// bit for bit, and the same merges. Moments random, so a lost or doubled piece shows.
TEST(ExpertMerging, ShardedMergeEqualsTheHostMerge) {
  ModelConfig config = small_moe();
  config.moe.router_bias = true;
  config.moe.bias_balancing = true;
  config.moe.merge_similarity = -1;
  config.moe.merge_pairs = 2;
  config.moe.merge_noise = 0.05;
  const std::vector<std::vector<int64_t>> load = {{10, 30, 20, 5, 50, 1, 2, 3}};
  const std::vector<std::vector<int64_t>> protect = {{6}};
  const auto build = [&](std::unique_ptr<Transformer<float>>& model, std::unique_ptr<AdamW>& optimizer) {
    model = std::make_unique<Transformer<float>>(config, 5);
    optimizer = std::make_unique<AdamW>(OptimizerConfig{}, model->params());
    CounterRng rng(3, "moments");
    auto& m = optimizer->first_moment();
    auto& v = optimizer->second_moment();
    for (size_t i = 0; i < m.size(); ++i) {
      m[i] = static_cast<float>(rng.normal(2 * i));
      v[i] = static_cast<float>(std::abs(rng.normal(2 * i + 1)));
    }
    auto& bias = model->moe_layers()[0]->balance_bias_E();
    for (size_t e = 0; e < bias.size(); ++e) bias[e] = 0.1f * static_cast<float>(e);
  };
  std::unique_ptr<Transformer<float>> want_model;
  std::unique_ptr<AdamW> want_optimizer;
  build(want_model, want_optimizer);
  const auto want = merge_host_experts(*want_model, *want_optimizer, config.moe, load, protect, 7, 4);
  ASSERT_EQ(want[0].size(), 2u);
  const auto flat = [](Transformer<float>& model, AdamW& optimizer) {
    std::vector<float> all;
    auto& params = model.params();
    for (int id = 0; id < params.size(); ++id) all.insert(all.end(), params.value(id), params.value(id) + params.numel(id));
    all.insert(all.end(), optimizer.first_moment().begin(), optimizer.first_moment().end());
    all.insert(all.end(), optimizer.second_moment().begin(), optimizer.second_moment().end());
    const auto& bias = model.moe_layers()[0]->balance_bias_E();
    all.insert(all.end(), bias.begin(), bias.end());
    return all;
  };
  const std::vector<float> want_state = flat(*want_model, *want_optimizer);
  dist::run_tcp_ranks(2, [&](std::unique_ptr<dist::Communicator>& world, int rank) {
    std::unique_ptr<Transformer<float>> model;
    std::unique_ptr<AdamW> optimizer;
    build(model, optimizer);
    const std::vector<float> before = flat(*model, *optimizer);
    SavedState saved;
    saved.pieces = host_state_pieces(*model, *optimizer, 2, rank);
    const auto got = merge_sharded_experts(
        *model, config.moe, saved, host_state_targets(*model, *optimizer),
        [&](float* data, int64_t n) { world->all_reduce(data, static_cast<size_t>(n), dist::DType::f32); }, load,
        protect, 7, 4);
    ASSERT_EQ(got[0].size(), want[0].size());
    for (size_t i = 0; i < want[0].size(); ++i) {
      EXPECT_EQ(got[0][i].kept, want[0][i].kept);
      EXPECT_EQ(got[0][i].freed, want[0][i].freed);
      EXPECT_EQ(got[0][i].split_of, want[0][i].split_of);
      EXPECT_EQ(got[0][i].similarity, want[0][i].similarity);
      EXPECT_EQ(got[0][i].kept_share, want[0][i].kept_share);
    }
    const std::vector<float> after = flat(*model, *optimizer);
    ASSERT_EQ(after.size(), want_state.size());
    size_t differ = 0, changed = 0;
    for (size_t i = 0; i < after.size(); ++i) {
      differ += std::memcmp(&after[i], &want_state[i], sizeof(float)) != 0;
      changed += after[i] != before[i];
    }
    EXPECT_EQ(differ, 0u) << "rank " << rank;
    EXPECT_GT(changed, 0u);
  });
}

}  // namespace
}  // namespace moe
