// kill -9 at random points of a CPU run (seeded), resuming each time with --resume=auto:
// the run still ends bit-identical to an uninterrupted one, and after every kill the
// newest checkpoint that resume would pick reads back complete and intact.
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <thread>

#include "train/test_resume_fixtures.h"
#include "train/checkpoint.h"
#include "core/atomic_file.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

class Kill9 : public test::TempDirTest {};

TEST_F(Kill9, FiveKillsThenResumeEndBitIdentical) {
  constexpr int kSteps = 12;
  const fs::path config = test::write_binary_run(dir_, kSteps);
  test::Child full({"train", "-c", config.string(), "--checkpoint.dir=" + (dir_ / "full").string()});
  ASSERT_EQ(full.wait(), 0) << full.output();

  std::mt19937 rng(20261129);
  std::string logs;
  int target = 0;
  for (int kill = 0; kill < 5; ++kill) {
    target += 1 + static_cast<int>(rng() % 2);  // strictly later each time: 5 kills within 10 steps
    test::Child child({"train", "-c", config.string(), "--resume=auto"});
    // The step's line is printed before its checkpoint is written; a random delay
    // after it lands the kill during the save, the next step or the validation.
    ASSERT_TRUE(child.read_until(fmt::format("{}/{} |", target, kSteps))) << child.output();
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
    child.signal(SIGKILL);
    const int status = child.wait();
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "run ended before the kill: " << child.output();
    logs += child.output();
    // Whatever the kill interrupted, what resume would pick is complete and verifies.
    // (A kill before the first save leaves none, and the next run starts over.)
    if (const auto latest = latest_checkpoint(dir_ / "ckpt")) EXPECT_NO_THROW(read_checkpoint(*latest)) << latest->string();
  }
  test::Child last({"train", "-c", config.string(), "--resume=auto"});
  ASSERT_EQ(last.wait(), 0) << last.output();
  logs += last.output();
  EXPECT_EQ(test::losses_by_step(logs), test::losses_by_step(full.output()));
  const std::string final_name = fmt::format("step_{:08d}", kSteps);
  test::expect_same_checkpoint_state(dir_ / "ckpt" / final_name, dir_ / "full" / final_name);
}

}  // namespace
}  // namespace moe
