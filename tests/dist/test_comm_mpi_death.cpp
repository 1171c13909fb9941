// A rank that dies mid-run (MOE_TEST_KILL_RANK=k): rank k kills itself after a barrier,
// the others hang, as they would in a collective with the dead rank. The launcher
// (mpirun or `moe launch`) must end the job with a non-zero exit. Skipped without the
// variable.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <thread>

#include "comm_mpi_world.h"

namespace moe::dist {
namespace {

TEST(RankDeath, KilledRankEndsTheJob) {
  const char* victim = std::getenv("MOE_TEST_KILL_RANK");
  if (victim == nullptr) GTEST_SKIP() << "set MOE_TEST_KILL_RANK to run";
  testing::world().barrier();
  if (testing::world().rank() == std::atoi(victim)) std::raise(SIGKILL);
  std::this_thread::sleep_for(std::chrono::seconds(120));
  ADD_FAILURE() << "rank " << testing::world().rank() << " was not stopped after the death of rank " << victim;
}

}  // namespace
}  // namespace moe::dist
