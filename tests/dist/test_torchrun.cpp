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

}  // namespace
}  // namespace moe
