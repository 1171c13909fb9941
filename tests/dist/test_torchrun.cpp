// `torchrun --nproc-per-node 2 --no-python moe train ...`, emulated (torch is not a test
// dependency): two `moe train` processes with torchrun's variables, while a stand-in for
// its agent's TCPStore holds MASTER_PORT, train over the tcp backend.
#include <gtest/gtest.h>

#include <filesystem>

#include "dist/torchrun_ranks.h"
#include "train/test_resume_fixtures.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

class Torchrun : public test::TempDirTest {};

TEST_F(Torchrun, TwoRanksTrainBesideTheStoreOnMasterPort) {
  const fs::path config = test::write_binary_run(dir_, 3);
  const auto ranks =
      test::run_torchrun_ranks(test::moe_binary(), {"train", "-c", config.string(), "--device=cpu"}, 2, dir_, 120);
  for (size_t r = 0; r < ranks.size(); ++r) EXPECT_EQ(ranks[r].exit_code, 0) << "rank " << r << ":\n" << ranks[r].output;
  EXPECT_NE(ranks[0].output.find("batch: 64 tokens/step = 2 ranks x 1 micro-batches x 2 x 16 tokens"),
            std::string::npos)
      << ranks[0].output;
  EXPECT_NE(ranks[0].output.find("summary: steps=3 "), std::string::npos) << ranks[0].output;
}

// Rank 0 alone checks the run's folders (only it writes there); when it refuses them every
// rank stops before step 1 with exit code 2, instead of waiting for rank 0.
TEST_F(Torchrun, EveryRankStopsWhenRankZeroRefusesTheFolders) {
  const fs::path config = test::write_binary_run(dir_, 3);
  const std::string metrics = "--metrics.dir=" + (dir_ / "metrics").string();
  test::Child first({"train", "-c", config.string(), metrics, "--checkpoint.dir="});
  ASSERT_EQ(first.wait(), 0) << first.output();
  const auto ranks = test::run_torchrun_ranks(test::moe_binary(),
                                              {"train", "-c", config.string(), "--device=cpu", metrics}, 2, dir_, 120);
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_EQ(ranks[r].exit_code, 2) << "rank " << r << ":\n" << ranks[r].output;
    EXPECT_EQ(ranks[r].output.find("step 1/"), std::string::npos) << ranks[r].output;
  }
  EXPECT_NE(ranks[0].output.find("moe: error: metrics.dir \"" + (dir_ / "metrics").string() + "\" holds another run's"),
            std::string::npos)
      << ranks[0].output;
  EXPECT_NE(ranks[1].output.find("moe: error: rank 0 refused the run's output folders"), std::string::npos)
      << ranks[1].output;
}

}  // namespace
}  // namespace moe
