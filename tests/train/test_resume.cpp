// Exact resume (in process and through the binary), NaN recovery by reload, the memory
// controller inside the trainer, and preemption by SIGTERM / SIGINT.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "test_resume_fixtures.h"
#include "core/atomic_file.h"
#include "train/signals.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using test::TempDirTest;

struct RunResult {
  std::vector<double> losses;  // per step, in the order the steps ran
  std::vector<double> lrs;
  std::vector<float> weights;
  std::string log;
};

RunResult run_trainer(const RunConfig& config, const std::string& resume_from = "",
                      const std::function<void(Trainer&, const StepStats&)>& hook = {}) {
  auto trainer = test::make_trainer(config);
  RunResult result;
  std::ostringstream log;
  if (!resume_from.empty()) trainer->resume(resume_from, log);
  Trainer* t = trainer.get();
  trainer->on_step = [&](const StepStats& stats) {
    result.losses.push_back(stats.loss);
    result.lrs.push_back(stats.lr);
    if (hook) hook(*t, stats);
  };
  trainer->run(log);
  result.weights = test::all_weights(*trainer);
  result.log = log.str();
  return result;
}

class Resume : public TempDirTest, public ::testing::WithParamInterface<bool> {};

// Stopped after step 3 (training.stop_at), resumed from its checkpoint: the same losses
// and final weights, bit for bit, as a run that was never interrupted.
void expect_stop_and_resume_bit_identical(RunConfig config, const fs::path& dir) {
  config.checkpoint.dir = (dir / "ckpt").string();
  config.checkpoint.interval = 2;
  config.model.moe.capacity_factor = 1.0;
  const RunResult full = run_trainer(config);
  ASSERT_EQ(full.losses.size(), 8u);

  config.checkpoint.dir = (dir / "ckpt2").string();
  config.training.stop_at = 3;
  const RunResult first = run_trainer(config);
  ASSERT_EQ(first.losses.size(), 3u) << first.log;
  EXPECT_NE(first.log.find("stopping after step 3 (training.stop_at)"), std::string::npos) << first.log;
  // The LR schedule is that of training.steps, not of stop_at.
  EXPECT_EQ(first.lrs, std::vector<double>(full.lrs.begin(), full.lrs.begin() + 3));

  config.training.stop_at = 0;
  const RunResult second = run_trainer(config, (dir / "ckpt2" / "step_00000003").string());
  ASSERT_EQ(second.losses.size(), 5u) << second.log;
  std::vector<double> losses = first.losses;
  losses.insert(losses.end(), second.losses.begin(), second.losses.end());
  EXPECT_EQ(losses, full.losses);
  EXPECT_EQ(second.weights, full.weights);
  // And the final checkpoints hold the same state (moments, bias, data position included).
  test::expect_same_checkpoint_state(dir / "ckpt2" / "step_00000008", dir / "ckpt" / "step_00000008");
  // Without restoring, the continuation differs: the test can tell.
  config.checkpoint.dir = "";
  auto fresh = test::make_trainer(config);
  EXPECT_NE(fresh->train_step(3).loss, second.losses[0]);
}

// Sync and async saves.
TEST_P(Resume, StopAndResumeIsBitIdentical) {
  RunConfig config = test::tiny_config();
  config.checkpoint.async = GetParam();
  expect_stop_and_resume_bit_identical(config, dir_);
}

// fp8 moments: the checkpoint keeps their stored values in fp32, which the optimizer reads
// back as they were (docs/FP8.md section 6).
TEST_F(TempDirTest, Fp8MomentsStopAndResumeIsBitIdentical) {
  RunConfig config = test::tiny_config();
  config.optimizer.state_dtype = MomentDtype::Fp8;
  expect_stop_and_resume_bit_identical(config, dir_);
}

// moe.temperature_control's per-layer state (temperature and smoothed imbalance) is in the
// checkpoint: stopped after step 3 and resumed, the run continues bit for bit, and the
// temperatures did move (a resume that lost them would route with the starting value).
TEST_F(TempDirTest, TemperatureControlResumesBitIdentical) {
  RunConfig config = test::tiny_config();
  config.model.moe.temperature_control = true;
  config.model.moe.temperature_gain = 0.5;
  config.metrics.alert_imbalance = 0.0;
  config.checkpoint.dir = (dir_ / "ckpt").string();
  config.checkpoint.interval = 3;
  std::vector<double> final_temperatures;
  auto record = [&](Trainer& t, const StepStats&) {
    final_temperatures.clear();
    for (auto* layer : t.model().moe_layers()) final_temperatures.push_back(layer->temperature());
  };
  const RunResult full = run_trainer(config, "", record);
  ASSERT_EQ(full.losses.size(), 8u);
  for (double t : final_temperatures) EXPECT_NE(t, 1.0);
  const std::vector<double> full_temperatures = final_temperatures;

  config.checkpoint.dir = (dir_ / "ckpt2").string();
  config.training.stop_at = 3;
  const RunResult first = run_trainer(config);
  config.training.stop_at = 0;
  const RunResult second = run_trainer(config, (dir_ / "ckpt2" / "step_00000003").string(), record);
  std::vector<double> losses = first.losses;
  losses.insert(losses.end(), second.losses.begin(), second.losses.end());
  EXPECT_EQ(losses, full.losses);
  EXPECT_EQ(second.weights, full.weights);
  EXPECT_EQ(final_temperatures, full_temperatures);
  test::expect_same_checkpoint_state(dir_ / "ckpt2" / "step_00000008", dir_ / "ckpt" / "step_00000008");
}

INSTANTIATE_TEST_SUITE_P(SyncAndAsync, Resume, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "async" : "sync"; });

// `moe eval`'s path: a fresh trainer loads a checkpoint's weights (not its data position or
// progress) and evaluates the held-out batches: the validation loss the saving run
// computed at that step, bit for bit; another checkpoint gives another loss.
class Evaluate : public TempDirTest {};

TEST_F(Evaluate, LoadedWeightsGiveTheSavingRunsValidationLoss) {
  RunConfig config = test::tiny_config();
  config.checkpoint.dir = (dir_ / "ckpt").string();
  config.checkpoint.interval = 4;
  auto trainer = test::make_trainer(config);
  std::ostringstream log;
  double at_step_4 = 0;
  trainer->on_step = [&](const StepStats& stats) {
    if (stats.step == 4) at_step_4 = trainer->validate();
  };
  trainer->run(log);
  config.checkpoint.dir = "";
  auto fresh = test::make_trainer(config);
  const double before = fresh->validate();
  EXPECT_EQ(fresh->load_weights((dir_ / "ckpt" / "step_00000004").string(), log), 4);
  EXPECT_EQ(fresh->progress().step, 0);  // the weights only
  int64_t calls = 0;
  const double loss = fresh->evaluate(config.training.val_batches, [&](int64_t done, int64_t total) {
    EXPECT_EQ(done, ++calls);
    EXPECT_EQ(total, config.training.val_batches);
  });
  EXPECT_EQ(calls, config.training.val_batches);
  EXPECT_EQ(loss, at_step_4);
  EXPECT_NE(loss, before);
  fresh->load_weights((dir_ / "ckpt" / "step_00000008").string(), log);
  EXPECT_NE(fresh->validate(), at_step_4);
}

// Non-finite weights make every step skip; after nan_max_skips in a row the trainer
// reloads the last checkpoint and goes on with the learning rate lowered.
class NanRecovery : public TempDirTest {};

TEST_F(NanRecovery, NonFiniteStepsReloadTheLastCheckpointWithALowerLr) {
  RunConfig config = test::tiny_config();
  config.checkpoint.dir = (dir_ / "ckpt").string();
  config.checkpoint.interval = 2;
  config.training.nan_max_skips = 2;
  config.training.nan_lr_factor = 0.25;
  const RunResult clean = run_trainer(config, "", {});
  fs::remove_all(dir_ / "ckpt");
  bool poisoned = false;
  const RunResult r = run_trainer(config, "", [&](Trainer& t, const StepStats& stats) {
    if (stats.step == 3 && !poisoned) {  // after step 3: weights turn NaN
      poisoned = true;
      auto& params = t.model().params();
      params.value(params.find("final_norm"))[0] = NAN;
    }
  });
  // Steps 1-3, then 4 and 5 skipped, reload of step 2, then steps 3..8 again.
  ASSERT_EQ(r.losses.size(), 3u + 2u + 6u) << r.log;
  EXPECT_TRUE(std::isnan(r.losses[3]) && std::isnan(r.losses[4]));
  EXPECT_NE(r.log.find("warning: step 4 skipped"), std::string::npos) << r.log;
  EXPECT_NE(r.log.find("warning: checkpoint at step 4 not saved: the step was skipped"), std::string::npos) << r.log;
  EXPECT_NE(r.log.find("warning: 2 non-finite steps in a row (up to step 5): reloaded"), std::string::npos) << r.log;
  EXPECT_NE(r.log.find("step_00000002 (step 2), learning rate x0.25"), std::string::npos) << r.log;
  for (size_t i = 5; i < r.losses.size(); ++i) EXPECT_TRUE(std::isfinite(r.losses[i])) << i;
  // The repeated step 3 runs from the same state as the first time but with lr x 0.25.
  EXPECT_EQ(r.losses[5], clean.losses[2]);
  EXPECT_DOUBLE_EQ(r.lrs[5], clean.lrs[2] * 0.25);
  EXPECT_DOUBLE_EQ(r.lrs.back(), clean.lrs.back() * 0.25);
  for (float w : r.weights) ASSERT_TRUE(std::isfinite(w));
  // The lowered rate is part of later checkpoints, so a resume keeps it.
  LoadedCheckpoint last = read_checkpoint(dir_ / "ckpt" / "step_00000008");
  EXPECT_EQ(last.manifest.lr_scale, 0.25);
  EXPECT_EQ(last.manifest.nan_reloads, 1);
  EXPECT_EQ(last.manifest.skipped_steps, 2);
}

TEST(NanRecoveryWithoutCheckpoint, TheRunStopsWithAClearError) {
  RunConfig config = test::tiny_config();
  config.training.nan_max_skips = 2;
  auto trainer = test::make_trainer(config);
  auto& params = trainer->model().params();
  params.value(params.find("final_norm"))[0] = NAN;
  std::ostringstream log;
  try {
    trainer->run(log);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 non-finite steps in a row (up to step 2) and no checkpoint to reload"),
              std::string::npos)
        << e.what();
  }
}

// A memory limit below the planned footprint halves the micro-batch and doubles the
// accumulation: same global batch, the same first-step loss within fp32 rounding.
TEST(MemoryPressure, ForcedLimitHalvesTheMicroBatch) {
  RunConfig config = test::tiny_config();
  config.model.seq_len = 64;
  config.training.micro_batch = 8;
  config.training.global_batch_tokens = 1024;  // 2 x 8 x 64
  config.training.steps = 1;
  auto whole = test::make_trainer(config);
  const size_t bytes_8 = whole->model().planned_bytes(8);
  const size_t bytes_4 = whole->model().planned_bytes(4);
  ASSERT_GT(bytes_8, bytes_4);
  // A limit between the two footprints (in MB, rounded up so that 4 fits).
  config.training.memory_limit_mb = static_cast<int64_t>((bytes_4 + 999999) / 1000000);
  ASSERT_LT(static_cast<size_t>(config.training.memory_limit_mb) * 1000000, bytes_8)
      << "the tiny model's footprints are too close for a MB limit";
  auto split = test::make_trainer(config);
  EXPECT_EQ(split->micro_batch(), 4);
  EXPECT_EQ(split->micro_batches_per_step(), 4);
  const StepStats a = whole->train_step(0), b = split->train_step(0);
  EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(a.loss));
  EXPECT_NE(a.loss, 0.0);
  std::ostringstream log;
  split->run(log);
  EXPECT_NE(log.str().find("memory: micro-batch 8 plans"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("halved to 4 x 4 accumulation steps (1024 tokens/step)"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("batch: 1024 tokens/step = 4 micro-batches x 4 x 64 tokens"), std::string::npos);
}

// A failed allocation of the activation arena (forced by a cap between the footprints
// of 8 and 4 sequences) halves the micro-batch as the memory limit does: the same tokens
// per step and the same first-step loss. It used to end the run with an uncaught error.
TEST(MemoryPressure, FailedArenaAllocationHalvesTheMicroBatch) {
  RunConfig config = test::tiny_config();
  config.model.seq_len = 64;
  config.training.micro_batch = 8;
  config.training.global_batch_tokens = 1024;  // 2 x 8 x 64
  config.training.steps = 1;
  auto whole = test::make_trainer(config);
  const size_t bytes_4 = whole->model().planned_bytes(4);  // both arenas of 4 sequences fit under it
  struct CapGuard {
    explicit CapGuard(size_t bytes) { Arena::set_capacity_cap_for_testing(bytes); }
    ~CapGuard() { Arena::set_capacity_cap_for_testing(0); }
  };
  std::unique_ptr<Trainer> split;
  {
    CapGuard cap(bytes_4);
    split = test::make_trainer(config);
  }
  EXPECT_EQ(split->micro_batch(), 4);
  EXPECT_EQ(split->micro_batches_per_step(), 4);
  const StepStats a = whole->train_step(0), b = split->train_step(0);
  EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(a.loss));
  EXPECT_NE(a.loss, 0.0);
  std::ostringstream log;
  split->run(log);
  EXPECT_NE(log.str().find("memory: micro-batch 8 failed to allocate (arena 'activations': cannot allocate"),
            std::string::npos)
      << log.str();
  EXPECT_NE(log.str().find("halved to 4 x 4 accumulation steps (1024 tokens/step)"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("batch: 1024 tokens/step = 4 micro-batches x 4 x 64 tokens"), std::string::npos);
}

class ResumeBinary : public TempDirTest {};

// Through the binary: training.stop_at, then --resume=auto, ends byte-identical to one run.
TEST_F(ResumeBinary, StopAtThenResumeAutoMatchesOneRun) {
  const fs::path config = test::write_binary_run(dir_, 6);
  test::Child full({"train", "-c", config.string(), "--checkpoint.dir=" + (dir_ / "full").string()});
  ASSERT_EQ(full.wait(), 0) << full.output();
  test::Child first({"train", "-c", config.string(), "--training.stop_at=4"});
  ASSERT_EQ(first.wait(), 0) << first.output();
  EXPECT_NE(first.output().find("stopping after step 4 (training.stop_at)"), std::string::npos) << first.output();
  test::Child second({"train", "-c", config.string(), "--resume=auto"});
  ASSERT_EQ(second.wait(), 0) << second.output();
  EXPECT_NE(second.output().find("resume: " + (dir_ / "ckpt" / "step_00000004").string() + " (step 4"),
            std::string::npos)
      << second.output();
  EXPECT_EQ(test::losses_by_step(first.output() + second.output()), test::losses_by_step(full.output()));
  test::expect_same_checkpoint_state(dir_ / "ckpt" / "step_00000006", dir_ / "full" / "step_00000006");
  // A different model shape is refused on one line, exit 2; a missing path too.
  test::Child other({"train", "-c", config.string(), "--resume=auto", "--model.dim=32"});
  EXPECT_EQ(WEXITSTATUS(other.wait()), 2) << other.output();
  EXPECT_NE(other.output().find("cannot resume: model.dim is 16 in the checkpoint but 32"), std::string::npos)
      << other.output();
  test::Child missing({"train", "-c", config.string(), "--resume=" + (dir_ / "nope").string()});
  EXPECT_EQ(WEXITSTATUS(missing.wait()), 2) << missing.output();
  EXPECT_NE(missing.output().find("no such checkpoint directory"), std::string::npos) << missing.output();
}

// Resuming an older checkpoint below later ones (another timeline) is refused on one line,
// exit 2, and nothing is touched; --discard-newer-checkpoints deletes them before step 1,
// and the new timeline's saves stay.
TEST_F(ResumeBinary, AnOlderCheckpointBelowLaterOnesIsRefusedOrDiscarded) {
  const fs::path config = test::write_binary_run(dir_, 6);  // a checkpoint every step
  const fs::path ckpt = dir_ / "ckpt";
  test::Child full({"train", "-c", config.string(), "--checkpoint.keep_last=10"});
  ASSERT_EQ(full.wait(), 0) << full.output();
  const std::string older = "--resume=" + (ckpt / "step_00000003").string();
  test::Child refused({"train", "-c", config.string(), older});
  EXPECT_EQ(WEXITSTATUS(refused.wait()), 2) << refused.output();
  EXPECT_NE(refused.output().find("holds later checkpoints (step_00000004 ... step_00000006): going on from step 3 "
                                  "would mix two timelines; add --discard-newer-checkpoints"),
            std::string::npos)
      << refused.output();
  EXPECT_EQ(latest_checkpoint(ckpt), ckpt / "step_00000006");
  test::Child discarded(
      {"train", "-c", config.string(), older, "--discard-newer-checkpoints", "--training.stop_at=4"});
  ASSERT_EQ(discarded.wait(), 0) << discarded.output();
  EXPECT_NE(discarded.output().find(
                "resume: deleted 3 later checkpoints of the discarded timeline (step_00000004 ... step_00000006)"),
            std::string::npos)
      << discarded.output();
  // keep_last = 2: the new step 4 and the resumed step 3 stay.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(ckpt)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000003", "step_00000004"}));
  test::Child alone({"train", "-c", config.string(), "--discard-newer-checkpoints"});
  EXPECT_EQ(WEXITSTATUS(alone.wait()), 2) << alone.output();
  EXPECT_NE(alone.output().find("--discard-newer-checkpoints goes with --resume"), std::string::npos)
      << alone.output();
}

// SIGTERM or SIGINT: the step finishes, a checkpoint is saved, exit 0, and a resume
// continues from it.
TEST_F(ResumeBinary, StopSignalFinishesTheStepSavesAndExitsZero) {
  const fs::path config = test::write_binary_run(dir_, 100000);
  for (int sig : {SIGTERM, SIGINT}) {
    SCOPED_TRACE(sig);
    fs::remove_all(dir_ / "ckpt");
    test::Child child({"train", "-c", config.string(), "--checkpoint.interval=0"});
    ASSERT_TRUE(child.read_until("3/100000 |")) << child.output();
    child.signal(sig);
    const int status = child.wait();
    ASSERT_TRUE(WIFEXITED(status)) << child.output();
    EXPECT_EQ(WEXITSTATUS(status), 0) << child.output();
    const std::string name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
    const auto at = child.output().find("stopping after step ");
    ASSERT_NE(at, std::string::npos) << child.output();
    const int64_t step = std::stoll(child.output().substr(at + 20));
    EXPECT_NE(child.output().find(fmt::format("stopping after step {} ({})", step, name)), std::string::npos);
    EXPECT_GE(step, 3);
    EXPECT_EQ(latest_checkpoint(dir_ / "ckpt"), dir_ / "ckpt" / fmt::format("step_{:08d}", step));
    EXPECT_NE(child.output().find("summary: steps="), std::string::npos);
  }
}

TEST_F(ResumeBinary, SecondSignalExitsAtOnce) {
  const fs::path config = test::write_binary_run(dir_, 100000);
  // Steps of tens of milliseconds, so both signals land inside one step.
  test::Child child({"train", "-c", config.string(), "--checkpoint.interval=0", "--model.dim=128",
                     "--model.seq_len=128", "--training.global_batch_tokens=1024", "--training.micro_batch=8",
                     "--model.vocab_size=4096"});
  ASSERT_TRUE(child.read_until("1/100000 |")) << child.output();
  child.signal(SIGTERM);
  // Two signals sent back to back would merge into one pending signal: wait for the first.
  ASSERT_TRUE(child.read_until("moe: stop requested")) << child.output();
  child.signal(SIGTERM);
  const int status = child.wait();
  ASSERT_TRUE(WIFEXITED(status)) << child.output();
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << child.output();
  EXPECT_EQ(child.output().find("stopping after step"), std::string::npos) << child.output();
  EXPECT_FALSE(latest_checkpoint(dir_ / "ckpt"));
}

}  // namespace
}  // namespace moe
