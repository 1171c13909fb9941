// Expert merging on one GPU (moe.merge_interval) against the CPU reference: two GPU runs of
// the same two steps, one merging after step 2; the first run's state (checkpoint) merged
// on the host by merge_host_experts must be the second run's state, every weight, AdamW
// moment and balancing bias.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <sstream>

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

std::vector<std::vector<int64_t>> run(const RunConfig& config) {
  const auto& m = config.model;
  Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                  std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
  EXPECT_TRUE(trainer.on_gpu());
  std::vector<std::vector<int64_t>> load_LE;
  trainer.on_step = [&](const StepStats& stats) {
    load_LE.clear();
    for (const LayerRouting& l : stats.layers) load_LE.push_back(l.tokens_E);
  };
  std::ostringstream log;
  trainer.run(log);
  return load_LE;
}

TEST(GpuExpertMerging, MergeMatchesTheCpuReference) {
  MOE_REQUIRE_GPU();
  const auto root = std::filesystem::temp_directory_path() / ("moe_gpu_merge_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  const RunConfig plain = merge_run(root / "plain", false), merging = merge_run(root / "merge", true);
  const auto load_LE = run(plain);
  run(merging);
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

}  // namespace
}  // namespace moe
