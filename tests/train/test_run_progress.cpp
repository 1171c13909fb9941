// What a run reports about the time it spends outside its steps: each checkpoint save's
// size, write time, rate and pause (on the console and as "checkpoint" records), the
// validations' durations, and both in the summary.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>
#include <string>

#include "obs/jsonl.h"
#include "test_resume_fixtures.h"
#include "train/checkpoint.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

int64_t bytes_in(const fs::path& dir) {
  int64_t total = 0;
  for (const auto& entry : fs::directory_iterator(dir)) total += static_cast<int64_t>(entry.file_size());
  return total;
}

class SaveReports : public test::TempDirTest, public ::testing::WithParamInterface<bool> {};

TEST_P(SaveReports, EverySaveReportsBytesTimeRateAndPause) {
  const bool async = GetParam();
  RunConfig config = test::tiny_config();
  config.checkpoint.dir = (dir_ / "ckpt").string();
  config.checkpoint.interval = 2;
  config.checkpoint.keep_last = 10;
  config.checkpoint.async = async;
  config.training.val_interval = 4;
  config.metrics.dir = (dir_ / "metrics").string();
  config.metrics.tensorboard = false;
  auto trainer = test::make_trainer(config);
  std::ostringstream log;
  const TrainSummary summary = trainer->run(log);
  const std::string text = log.str();
  const size_t summary_at = text.find("summary: steps=8 ");
  ASSERT_NE(summary_at, std::string::npos) << text;
  for (int step : {2, 4, 6, 8}) {
    SCOPED_TRACE(step);
    const std::string path = (dir_ / "ckpt" / fmt::format("step_{:08d}", step)).string();
    const std::string saved = fmt::format("checkpoint: step {} saved to {} | ", step, path);
    const size_t at = text.find(saved);
    ASSERT_NE(at, std::string::npos) << text;
    EXPECT_LT(at, summary_at) << "reported before the summary";
    const std::string line = text.substr(at, text.find('\n', at) - at);
    EXPECT_NE(line.find(" MB in "), std::string::npos) << line;
    EXPECT_NE(line.find(" GB/s"), std::string::npos) << line;
    if (async) {
      EXPECT_NE(line.find("(in the background)"), std::string::npos) << line;
      EXPECT_NE(text.find(fmt::format("checkpoint: step {} saving to {} in the background | training paused ", step,
                                      path)),
                std::string::npos)
          << text;
    } else {
      EXPECT_NE(line.find(" | training paused "), std::string::npos) << line;
    }
  }
  EXPECT_NE(text.find("val step 4 | val_loss "), std::string::npos) << text;
  EXPECT_NE(text.find(fmt::format(" validation_seconds={:.1f} checkpoint_seconds={:.1f}\n", summary.validation_seconds,
                                  summary.checkpoint_seconds)),
            std::string::npos)
      << text;
  // The records: one per save with the bytes on disk; the summary adds up the pauses.
  double paused = 0;
  int saves = 0, validations = 0;
  for (const auto& r : read_jsonl((dir_ / "metrics" / "metrics.jsonl").string())) {
    if (r["type"] == "checkpoint") {
      ++saves;
      const fs::path path = r["path"].get<std::string>();
      EXPECT_EQ(path, dir_ / "ckpt" / fmt::format("step_{:08d}", r["step"].get<int>()));
      EXPECT_EQ(r["bytes"].get<int64_t>(), bytes_in(path)) << path;
      EXPECT_GT(r["write_seconds"].get<double>(), 0.0);
      EXPECT_EQ(r["background"].get<bool>(), async);
      paused += r["paused_seconds"].get<double>();
    } else if (r["type"] == "val") {
      if (r["step"].get<int>() > 0) ++validations;
      EXPECT_GE(r["seconds"].get<double>(), 0.0);
    } else if (r["type"] == "summary") {
      EXPECT_DOUBLE_EQ(r["checkpoint_seconds"].get<double>(), summary.checkpoint_seconds);
      EXPECT_DOUBLE_EQ(r["validation_seconds"].get<double>(), summary.validation_seconds);
    }
  }
  EXPECT_EQ(saves, 4);
  EXPECT_EQ(validations, 2);  // steps 4 and 8
  EXPECT_NEAR(summary.checkpoint_seconds, paused, 1e-9);
  EXPECT_LE(summary.validation_seconds + summary.checkpoint_seconds, summary.seconds);
}

INSTANTIATE_TEST_SUITE_P(SyncAndAsync, SaveReports, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Async" : "Sync"; });

}  // namespace
}  // namespace moe
