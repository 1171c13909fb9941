// A run's output folders belong to one run (src/train/run_dirs.h): a new run does not
// write over another's metrics or mix its checkpoints with another's; a resumed run goes
// on with its own records, each step once.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/error.h"
#include "obs/jsonl.h"
#include "test_resume_fixtures.h"
#include "train/checkpoint.h"
#include "core/atomic_file.h"
#include "train/run_dirs.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

class RunDirs : public test::TempDirTest {
 protected:
  RunConfig config() const {
    RunConfig c = test::tiny_config();
    c.metrics.dir = (dir_ / "metrics").string();
    c.metrics.tensorboard = false;
    c.checkpoint.dir = (dir_ / "ckpt").string();
    c.checkpoint.interval = 4;
    return c;
  }
  // The ConfigError a trainer's run() throws before its first step ("" when it trains).
  static std::string refusal(Trainer& trainer, std::string* log = nullptr) {
    std::ostringstream out;
    try {
      trainer.run(out);
    } catch (const ConfigError& e) {
      if (log) *log = out.str();
      return e.what();
    }
    if (log) *log = out.str();
    return "";
  }
};

TEST_F(RunDirs, TheRunWritesItsIdAndResolvedConfig) {
  auto trainer = test::make_trainer(config());
  EXPECT_EQ(refusal(*trainer), "");
  EXPECT_EQ(metrics_run_id(config().metrics.dir), trainer->run_id());
  EXPECT_EQ(read_file_bytes(dir_ / "metrics" / "config.toml"), config_to_toml(config()));
  EXPECT_EQ(read_checkpoint(dir_ / "ckpt" / "step_00000008").run_id, trainer->run_id());
  EXPECT_EQ(read_jsonl((dir_ / "metrics" / "metrics.jsonl").string()).front()["run_id"], trainer->run_id());
  EXPECT_EQ(trainer->run_id().size(), 16u);
  EXPECT_NE(test::make_trainer(config())->run_id(), trainer->run_id());
}

// A new run into another run's folders stops before step 1 with one line saying how to go
// on, and leaves the files as they were.
TEST_F(RunDirs, ANewRunRefusesAnotherRunsFolders) {
  auto first = test::make_trainer(config());
  ASSERT_EQ(refusal(*first), "");
  const std::string metrics = read_file_bytes(dir_ / "metrics" / "metrics.jsonl");
  std::string log;
  std::string error = refusal(*test::make_trainer(config()), &log);
  EXPECT_EQ(error, fmt::format("metrics.dir \"{}\" holds another run's files (run {}: config.toml, metrics.jsonl, "
                               "run.json): continue that run with --resume auto, or choose another metrics.dir",
                               config().metrics.dir, first->run_id()));
  EXPECT_EQ(log.find("step 1/"), std::string::npos) << log;
  EXPECT_EQ(read_file_bytes(dir_ / "metrics" / "metrics.jsonl"), metrics);
  // Its checkpoints too, with another metrics.dir.
  RunConfig other = config();
  other.metrics.dir = (dir_ / "metrics2").string();
  error = refusal(*test::make_trainer(other));
  EXPECT_EQ(error, fmt::format("checkpoint.dir \"{}\" holds checkpoints of another run (run {}: step_00000004 ... "
                               "step_00000008): continue that run with --resume auto, or choose another checkpoint.dir",
                               other.checkpoint.dir, first->run_id()));
  EXPECT_FALSE(fs::exists(dir_ / "metrics2" / "metrics.jsonl"));
  // Metrics written before run ids (no run.json) count as another run's too.
  fs::remove(dir_ / "metrics" / "run.json");
  other = config();
  other.checkpoint.dir = "";
  EXPECT_NE(refusal(*test::make_trainer(other)).find("holds another run's files (config.toml, metrics.jsonl)"),
            std::string::npos);
}

// A run resumed from another run's checkpoint does not continue this metrics.dir's run.
TEST_F(RunDirs, AResumedRunRefusesAnotherRunsMetrics) {
  auto first = test::make_trainer(config());
  ASSERT_EQ(refusal(*first), "");
  RunConfig other = config();
  other.metrics.dir = (dir_ / "metrics2").string();
  other.checkpoint.dir = (dir_ / "ckpt2").string();
  auto second = test::make_trainer(other);
  ASSERT_EQ(refusal(*second), "");
  other.checkpoint.dir = (dir_ / "ckpt3").string();
  auto third = test::make_trainer(other);
  std::ostringstream out;
  third->resume((dir_ / "ckpt" / "step_00000004").string(), out);
  EXPECT_EQ(third->run_id(), first->run_id());
  EXPECT_EQ(refusal(*third), fmt::format("metrics.dir \"{}\" holds the metrics of run {}, but the checkpoint being "
                                         "resumed belongs to run {}: choose another metrics.dir (or that run's)",
                                         other.metrics.dir, second->run_id(), first->run_id()));
}

// `--resume auto` when nothing was saved yet (a job restarted before its first save)
// starts over as the same run: its metrics start again, no refusal.
TEST_F(RunDirs, ResumeWithNothingSavedStartsTheSameRunOver) {
  RunConfig c = config();
  c.checkpoint.dir = "";
  c.training.stop_at = 3;
  auto first = test::make_trainer(c);
  ASSERT_EQ(refusal(*first), "");
  c.checkpoint.dir = (dir_ / "ckpt").string();
  auto again = test::make_trainer(c);
  again->continue_run();
  EXPECT_EQ(again->run_id(), first->run_id());
  ASSERT_EQ(refusal(*again), "");
  const auto records = read_jsonl((dir_ / "metrics" / "metrics.jsonl").string());
  int runs = 0, steps = 0;
  for (const auto& r : records) {
    runs += r["type"] == "run";
    steps += r["type"] == "step";
  }
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(steps, 3);
}

// An unusable checkpoint.dir is found before step 1, as metrics.dir is, not at the first
// save (with checkpoint.interval = 0, after the whole run). (The tests run as root, whom
// read-only permissions do not stop: a file, and a path under a file.)
TEST_F(RunDirs, AnUnusableFolderIsRefusedBeforeStepOne) {
  std::ofstream(dir_ / "file") << "not a folder";
  const std::string file = (dir_ / "file").string(), under = (dir_ / "file" / "ckpt").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {file, "checkpoint.dir \"" + file + "\" is a file, not a directory"},
      {under, "checkpoint.dir \"" + under + "\": cannot create it: Not a directory"}};
  for (const auto& [path, message] : cases) {
    SCOPED_TRACE(path);
    RunConfig c = config();
    c.checkpoint.dir = path;
    c.checkpoint.interval = 0;
    std::string log;
    EXPECT_EQ(refusal(*test::make_trainer(c), &log), message);
    EXPECT_EQ(log.find("step 1/"), std::string::npos) << log;
  }
  RunConfig c = config();
  c.metrics.dir = file;
  EXPECT_EQ(refusal(*test::make_trainer(c)), "metrics.dir \"" + file + "\" is a file, not a directory");
  // Through the binary: exit 2, one line.
  const fs::path run = test::write_binary_run(dir_, 3);
  test::Child child({"train", "-c", run.string(), "--checkpoint.dir=" + under, "--checkpoint.interval=0"});
  EXPECT_EQ(WEXITSTATUS(child.wait()), 2) << child.output();
  EXPECT_NE(child.output().find("moe: error: checkpoint.dir \"" + under + "\": cannot create it: Not a directory\n"),
            std::string::npos)
      << child.output();
}

// Through the binary, as a user meets it: a second `moe train` into the same folders is
// refused (exit 2, one line); --resume auto goes on from the checkpoint, and the records
// hold every step once.
TEST_F(RunDirs, TheBinaryRefusesThenResumes) {
  const fs::path run = test::write_binary_run(dir_, 6);
  const std::string metrics = "--metrics.dir=" + (dir_ / "metrics").string();
  test::Child first({"train", "-c", run.string(), metrics, "--training.stop_at=4"});
  ASSERT_EQ(first.wait(), 0) << first.output();
  test::Child again({"train", "-c", run.string(), metrics});
  EXPECT_EQ(WEXITSTATUS(again.wait()), 2) << again.output();
  const std::string& out = again.output();
  const auto error = out.find("moe: error: metrics.dir");
  ASSERT_NE(error, std::string::npos) << out;
  EXPECT_NE(out.find("continue that run with --resume auto"), std::string::npos) << out;
  EXPECT_EQ(out.find('\n', error), out.size() - 1) << out;
  test::Child resumed({"train", "-c", run.string(), metrics, "--resume=auto"});
  ASSERT_EQ(resumed.wait(), 0) << resumed.output();
  std::map<int64_t, int> steps;
  for (const auto& r : read_jsonl((dir_ / "metrics" / "metrics.jsonl").string()))
    if (r["type"] == "step") ++steps[r["step"].get<int64_t>()];
  EXPECT_EQ(steps, (std::map<int64_t, int>{{1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}}));
  int event_files = 0;
  for (const auto& entry : fs::directory_iterator(dir_ / "metrics"))
    event_files += entry.path().filename().string().find("tfevents") != std::string::npos;
  EXPECT_EQ(event_files, 1);
}

}  // namespace
}  // namespace moe
