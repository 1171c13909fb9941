// The console line of a checkpoint save: sizes, speeds, and the pause, with the part of it
// spent waiting for the previous background save said apart.
#include <gtest/gtest.h>

#include "obs/observer.h"

namespace moe {
namespace {

TEST(CheckpointLine, SaysThePauseAndWhatOfItWaitedForThePreviousSave) {
  CheckpointSave save;
  save.step = 120;
  save.path = "ckpt/step_00000120";
  save.written = true;
  save.bytes = 4'000'000'000;
  save.write_seconds = 2.0;
  save.paused_seconds = 2.5;
  EXPECT_EQ(describe(save), "checkpoint: step 120 saved to ckpt/step_00000120 | 4.00 GB in 2.00 s, 2.00 GB/s | "
                            "training paused 2.5 s");
  save.waited_seconds = 1.3;
  EXPECT_EQ(describe(save), "checkpoint: step 120 saved to ckpt/step_00000120 | 4.00 GB in 2.00 s, 2.00 GB/s | "
                            "training paused 2.5 s (1.3 s of it waiting for the previous save)");
  save.background = true;
  save.written = false;
  EXPECT_EQ(describe(save), "checkpoint: step 120 saving to ckpt/step_00000120 in the background | training paused "
                            "2.5 s (1.3 s of it waiting for the previous save)");
  save.waited_seconds = 0.01;  // too little to mention
  EXPECT_EQ(describe(save), "checkpoint: step 120 saving to ckpt/step_00000120 in the background | training paused 2.5 s");
}

}  // namespace
}  // namespace moe
