// Expert merging on the GPU (moe.merge_interval) against the CPU reference: two GPU runs of
// the same two steps, one merging after step 2; the first run's state (checkpoint) merged
// on the host by merge_host_experts must be the second run's state, every weight, AdamW
// moment and balancing bias. On one GPU and over thread ranks sharing it (data parallel at
// ZeRO 0-3, expert parallel, both): each rank's pieces summed into whole tensors, merged,
// written back (GpuBackend::merge_experts), so the checkpoint is the host merge's state.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <sstream>

#include <thread>

#include "dist/cuda/thread_communicator.h"
#include "gpu_test_util.h"
#include "train/checkpoint.h"
#include "train/expert_merging.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe {
namespace {

RunConfig merge_run(const std::filesystem::path& dir, bool merging) {
  RunConfig config = test::tiny_gpu_run(2);
  config.model.moe.n_experts = 8;
  config.model.moe.router_bias = true;
  config.model.moe.bias_balancing = true;
  config.model.moe.merge_interval = merging ? 2 : 0;
  config.model.moe.merge_similarity = -1;
  config.model.moe.merge_pairs = 2;
  config.training.deterministic = true;
  config.checkpoint.dir = dir.string();
  config.checkpoint.interval = 2;
  return config;
}

// Rank 0's loads of the last step (summed over the ranks).
std::vector<std::vector<int64_t>> run(const RunConfig& config, int ranks) {
  std::vector<std::unique_ptr<dist::Communicator>> worlds = dist::make_thread_communicators(ranks);
  std::vector<std::vector<int64_t>> load_LE;
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        const auto& m = config.model;
        Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                        std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2),
                        std::move(worlds[static_cast<size_t>(r)]));
        EXPECT_TRUE(trainer.on_gpu());
        if (r == 0)
          trainer.on_step = [&](const StepStats& stats) {
            load_LE.clear();
            for (const LayerRouting& l : stats.layers) load_LE.push_back(l.tokens_E);
          };
        std::ostringstream log;
        trainer.run(log);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  return load_LE;
}

struct Layout {
  int ranks = 1, ep = 1, zero = 0;
  bool rebalance = false, split = false;  // re-placement by load every step, split experts
};

class GpuExpertMerging : public ::testing::TestWithParam<Layout> {};

TEST_P(GpuExpertMerging, MergeMatchesTheCpuReference) {
  MOE_REQUIRE_GPU();
  const Layout layout = GetParam();
  const auto root = std::filesystem::temp_directory_path() /
                    ("moe_gpu_merge_" + std::to_string(::getpid()) + "_" + std::to_string(layout.ranks) + "_" +
                     std::to_string(layout.ep) + "_" + std::to_string(layout.zero) + "_" +
                     std::to_string(layout.rebalance) + std::to_string(layout.split));
  std::filesystem::remove_all(root);
  RunConfig plain = merge_run(root / "plain", false), merging = merge_run(root / "merge", true);
  for (RunConfig* c : {&plain, &merging}) {
    c->training.micro_batch /= layout.ranks;  // the same global batch
    c->parallel.expert_parallel = layout.ep;
    c->parallel.zero = layout.zero;
    c->parallel.rebalance_interval = layout.rebalance ? 1 : 0;
    c->parallel.split_experts = layout.split;
  }
  const auto load_LE = run(plain, layout.ranks);
  run(merging, layout.ranks);
  ASSERT_FALSE(HasFailure());
  const LoadedCheckpoint a = read_checkpoint(root / "plain" / "step_00000002");
  const LoadedCheckpoint b = read_checkpoint(root / "merge" / "step_00000002");
  // The plain run's state into a host model and AdamW, merged there by the CPU reference.
  Transformer<float> model(merging.model, merging.training.seed);
  AdamW optimizer(merging.optimizer, model.params());
  auto& params = model.params();
  for (int id = 0; id < params.size(); ++id) {
    const std::string& name = params.spec(id).name;
    const auto value = read_tensor(a, "param/" + name), m = read_tensor(a, "adam_m/" + name),
               v = read_tensor(a, "adam_v/" + name);
    std::copy(value.begin(), value.end(), params.value(id));
    std::copy(m.begin(), m.end(), optimizer.first_moment().begin() + optimizer.moment_offset(id));
    std::copy(v.begin(), v.end(), optimizer.second_moment().begin() + optimizer.moment_offset(id));
  }
  for (auto* layer : model.moe_layers()) {
    const auto bias = read_tensor(a, "balance_bias/" + layer->prefix());
    std::copy(bias.begin(), bias.end(), layer->balance_bias_E().begin());
  }
  const auto merges = merge_host_experts(model, optimizer, merging.model.moe, load_LE, {}, merging.training.seed, 2);
  ASSERT_EQ(merges.size(), 2u);
  for (const auto& layer : merges) EXPECT_EQ(layer.size(), 2u);
  const auto close = [](const std::vector<float>& x, const float* y, const std::string& what) {
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(double(x[i]) - y[i]) / (1e-6 + std::abs(y[i])));
    EXPECT_LT(worst, 1e-5) << what;
  };
  int differ = 0;
  for (int id = 0; id < params.size(); ++id) {
    const std::string& name = params.spec(id).name;
    const auto value = read_tensor(b, "param/" + name);
    close(value, params.value(id), "param/" + name);
    close(read_tensor(b, "adam_m/" + name), optimizer.first_moment().data() + optimizer.moment_offset(id), "adam_m/" + name);
    close(read_tensor(b, "adam_v/" + name), optimizer.second_moment().data() + optimizer.moment_offset(id), "adam_v/" + name);
    differ += read_tensor(a, "param/" + name) != value;
  }
  EXPECT_GT(differ, 0);  // the merge changed the state: the test can tell
  for (auto* layer : model.moe_layers())
    close(read_tensor(b, "balance_bias/" + layer->prefix()), layer->balance_bias_E().data(), "balance_bias");
  std::filesystem::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuExpertMerging,
                         ::testing::Values(Layout{1, 1, 0}, Layout{2, 1, 0}, Layout{2, 1, 1}, Layout{2, 1, 3},
                                           Layout{2, 2, 0}, Layout{4, 2, 1}, Layout{2, 2, 0, true},
                                           Layout{2, 2, 0, true, true}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           const Layout& l = info.param;
                           return "ranks" + std::to_string(l.ranks) + "_ep" + std::to_string(l.ep) + "_zero" +
                                  std::to_string(l.zero) + (l.rebalance ? "_replaced" : "") + (l.split ? "_split" : "");
                         });

}  // namespace
}  // namespace moe
