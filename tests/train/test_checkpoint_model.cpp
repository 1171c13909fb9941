// A checkpoint's model for generation: the weights and balancing biases load bit for bit,
// and a model trained on the look-back task (the output at position i is a fixed
// permutation of the token at i - 2) generates, greedily and through window slides, the
// sequence the task defines.
#include <gtest/gtest.h>

#include <map>
#include <sstream>

#include "core/threads.h"
#include "model/generator.h"
#include "synthetic.h"
#include "train/checkpoint_model.h"
#include "train/test_resume_fixtures.h"
#include "train/trainer.h"

namespace moe {
namespace {

using test::TempDirTest;

class CheckpointModelTest : public TempDirTest {};

TEST_F(CheckpointModelTest, GeneratesTheLookBackSequenceItLearnt) {
  set_num_threads(0);
  RunConfig config = test::lookback_config();
  config.model.moe.bias_balancing = true;  // non-zero balancing biases to load
  config.checkpoint.dir = (dir_ / "ckpt").string();
  // The checkpoint's config is validated when read, and the byte tokenizer would need 257
  // ids; a tokenizer.json spec bounds nothing (no tokenizer is opened here).
  config.data.tokenizer = "unused/tokenizer.json";
  Trainer trainer(config, std::make_unique<test::LookBackTask>(16, 16, 1),
                  std::make_unique<test::LookBackTask>(16, 16, 2));
  std::ostringstream log;
  const TrainSummary summary = trainer.run(log);
  ASSERT_LT(summary.val_loss_end, 0.05) << log.str();

  const std::string path = (dir_ / "ckpt" / "step_00000150").string();
  const CheckpointModel loaded = load_checkpoint_model(path, {}, log);
  EXPECT_EQ(loaded.step, 150);
  // Overrides apply to the run's config; one that changes the model's shape is refused.
  std::ostringstream warnings;
  EXPECT_EQ(load_checkpoint_model(path, {"data.dir=/elsewhere"}, warnings).config.data.dir, "/elsewhere");
  EXPECT_NE(warnings.str().find("warning: resume: data.dir was"), std::string::npos) << warnings.str();
  EXPECT_THROW(load_checkpoint_model(path, {"model.dim=64"}, warnings), ConfigError);
  const ParameterStore<float>& saved = trainer.model().params();
  const ParameterStore<float>& read = loaded.model->params();
  ASSERT_EQ(read.size(), saved.size());
  for (int id = 0; id < saved.size(); ++id)
    EXPECT_TRUE(std::equal(saved.value(id), saved.value(id) + saved.numel(id), read.value(id))) << saved.spec(id).name;
  EXPECT_NE(trainer.model().moe_layers()[0]->balance_bias_E(), std::vector<float>(4, 0.0f));
  EXPECT_EQ(loaded.model->moe_layers()[1]->balance_bias_E(), trainer.model().moe_layers()[1]->balance_bias_E());

  // The task's permutation, read off a batch: target s = permutation[input s - 2].
  test::LookBackTask task(16, 16, 3);
  std::vector<int32_t> inputs(16 * 64), targets(inputs.size());
  task.next_batch(64, inputs.data(), targets.data());
  std::map<int32_t, int32_t> permutation;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (i % 16 >= 2) permutation[inputs[i - 2]] = targets[i];
  ASSERT_EQ(permutation.size(), 16u);

  const std::unique_ptr<Decoder> decoder = make_decoder(*loaded.model, "cpu");
  GenerateOptions options;
  options.max_tokens = 40;  // past the 16-token context: 3 slides to 8 tokens
  options.sampling.temperature = 0;
  const std::vector<int32_t> prompt = {5, 11, 3};
  const GenerateResult result = generate(*decoder, prompt, options);
  EXPECT_EQ(result.slides, 3);
  std::vector<int32_t> sequence = prompt, expected = prompt;
  sequence.insert(sequence.end(), result.tokens.begin(), result.tokens.end());
  // The output at position i is the permutation of the token at i - 2: the next token, at
  // i + 1, is the permutation of the one three places before it.
  for (size_t i = 3; i < sequence.size(); ++i) expected.push_back(permutation[expected[i - 3]]);
  EXPECT_EQ(sequence, expected);
}

}  // namespace
}  // namespace moe
