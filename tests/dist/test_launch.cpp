// `moe launch`: runs workers to completion, stops everyone when one dies, forwards
// signals, and never hangs. The workers are moe_mpi_tests (beside the moe binary) on the
// tcp backend, or plain programs.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

std::string moe_binary() {
  const char* path = std::getenv("MOE_BINARY");
  return path ? path : "./moe";
}

std::string mpi_tests_binary() {
  return (std::filesystem::path(moe_binary()).parent_path() / "moe_mpi_tests").string();
}

struct Outcome {
  int status = 0;
  double seconds = 0;
  bool timed_out = false;
};

// Starts argv with extra environment variables; after `signal_after` seconds (if >= 0)
// sends SIGTERM; kills the whole thing after timeout_s.
Outcome run_with_timeout(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
                         double timeout_s, double signal_after = -1) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) env_strings.push_back(*e);
  for (const std::string& e : extra_env) env_strings.push_back(e);
  std::vector<char*> envp, args;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (std::string& a : argv_copy) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = -1;
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  // Its own process group, so that a timeout can kill the launcher and its workers.
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attributes, 0);
  // The workers' gtest output goes nowhere: their "[  SKIPPED ]" lines (tests that need 4
  // ranks) would make ctest report this test as skipped. stderr stays for diagnostics.
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  const int spawned = posix_spawn(&pid, args[0], &files, &attributes, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attributes);
  EXPECT_EQ(spawned, 0) << "cannot start " << argv[0];
  Outcome outcome;
  if (spawned != 0) return outcome;
  const auto start = Clock::now();
  bool signalled = false;
  while (true) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (waitpid(pid, &outcome.status, WNOHANG) == pid) {
      outcome.seconds = elapsed;
      return outcome;
    }
    if (signal_after >= 0 && !signalled && elapsed > signal_after) {
      kill(pid, SIGTERM);
      signalled = true;
    }
    if (elapsed > timeout_s) {
      kill(-pid, SIGKILL);
      waitpid(pid, &outcome.status, 0);
      outcome.timed_out = true;
      outcome.seconds = elapsed;
      return outcome;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int exit_code(const Outcome& outcome) {
  return WIFEXITED(outcome.status) ? WEXITSTATUS(outcome.status) : 128 + WTERMSIG(outcome.status);
}

TEST(Launch, TwoWorkersRunToCompletion) {
  const Outcome outcome = run_with_timeout(
      {moe_binary(), "launch", "--nproc-per-node", "2", "--", mpi_tests_binary(), "--gtest_brief=1"}, {}, 60);
  EXPECT_FALSE(outcome.timed_out);
  EXPECT_EQ(exit_code(outcome), 0);
}

TEST(Launch, AKilledWorkerStopsTheOthersAndFailsTheJob) {
  // Rank 1 kills itself; rank 0 would sleep two minutes unless the launcher stops it.
  const Outcome outcome =
      run_with_timeout({moe_binary(), "launch", "--nproc-per-node", "2", "--grace-period", "2", "--",
                        mpi_tests_binary(), "--gtest_filter=RankDeath.*"},
                       {"MOE_TEST_KILL_RANK=1"}, 30);
  EXPECT_FALSE(outcome.timed_out);
  EXPECT_EQ(exit_code(outcome), 128 + SIGKILL);  // the dead worker's status
  EXPECT_LT(outcome.seconds, 15);
}

TEST(Launch, WorkersIgnoringSigtermAreKilledAfterTheGracePeriod) {
  // Rank 0 ignores SIGTERM, so only SIGKILL ends it; rank 1 dies as soon as rank 0's trap
  // is set (before, a SIGTERM could reach rank 0's shell first on a loaded machine).
  const std::string marker = ::testing::TempDir() + "moe_launch_trap_" + std::to_string(getpid());
  std::remove(marker.c_str());
  const Outcome outcome = run_with_timeout(
      {moe_binary(), "launch", "--nproc-per-node", "2", "--grace-period", "1", "--", "/bin/sh", "-c",
       "if [ \"$LOCAL_RANK\" = 1 ]; then while [ ! -e \"$TRAP_MARKER\" ]; do sleep 0.01; done; exit 3; fi; "
       "trap '' TERM; touch \"$TRAP_MARKER\"; exec sleep 60"},
      {"TRAP_MARKER=" + marker}, 30);
  std::remove(marker.c_str());
  EXPECT_FALSE(outcome.timed_out);
  EXPECT_EQ(exit_code(outcome), 3);
  EXPECT_GE(outcome.seconds, 0.9);
  EXPECT_LT(outcome.seconds, 10);
}

TEST(Launch, AFailingWorkerFailsTheJob) {
  const Outcome outcome = run_with_timeout({moe_binary(), "launch", "--nproc-per-node", "2", "--", "/bin/false"}, {}, 30);
  EXPECT_FALSE(outcome.timed_out);
  EXPECT_EQ(exit_code(outcome), 1);
}

TEST(Launch, SigtermIsForwardedToTheWorkers) {
  const Outcome outcome = run_with_timeout(
      {moe_binary(), "launch", "--nproc-per-node", "2", "--", "/bin/sleep", "60"}, {}, 30, /*signal_after=*/1.0);
  EXPECT_FALSE(outcome.timed_out);
  EXPECT_EQ(exit_code(outcome), 128 + SIGTERM);
  EXPECT_LT(outcome.seconds, 10);
}

TEST(Launch, WorkersDieWithAKilledLauncher) {
  // SIGKILL cannot be forwarded: the workers' parent-death signal ends them instead.
  const std::string marker = ::testing::TempDir() + "moe_launch_orphan_" + std::to_string(getpid());
  const std::string ready = marker + "_ready";  // the worker's trap is set: the kill may come
  std::remove(marker.c_str());
  std::remove(ready.c_str());
  std::vector<std::string> argv = {moe_binary(), "launch", "--nproc-per-node", "1", "--", "/bin/sh", "-c",
                                   "trap 'touch " + marker + "; exit 0' TERM; touch " + ready + "; sleep 30 & wait"};
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ), 0);
  const auto spawned = Clock::now();
  while (!std::filesystem::exists(ready) && Clock::now() - spawned < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(std::filesystem::exists(ready)) << "the worker did not start";
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  const auto start = Clock::now();
  while (!std::filesystem::exists(marker) && Clock::now() - start < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(std::filesystem::exists(marker)) << "the worker did not get SIGTERM when its launcher died";
  std::remove(marker.c_str());
  std::remove(ready.c_str());
}

TEST(Launch, WorkersSeeTheirIdentity) {
  // Each worker checks its variables with a shell; a wrong value fails the job.
  const std::string check =
      "test \"$WORLD_SIZE\" = 4 && test \"$LOCAL_WORLD_SIZE\" = 2 && test \"$GROUP_RANK\" = 1 && "
      "test \"$RANK\" = $((2 + LOCAL_RANK)) && test \"$MASTER_ADDR\" = 127.0.0.1 && test \"$MASTER_PORT\" = 29999";
  const Outcome outcome =
      run_with_timeout({moe_binary(), "launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
                        "--master", "127.0.0.1:29999", "--", "/bin/sh", "-c", check},
                       {}, 30);
  EXPECT_EQ(exit_code(outcome), 0);
}

TEST(Launch, BadArgumentsAreUsageErrors) {
  EXPECT_EQ(exit_code(run_with_timeout({moe_binary(), "launch", "--nproc-per-node", "2", "--nnodes", "2",
                                        "--node-rank", "2", "--master", "h:1", "--", "/bin/true"},
                                       {}, 30)),
            2);
  EXPECT_EQ(exit_code(run_with_timeout(
                {moe_binary(), "launch", "--nproc-per-node", "2", "--nnodes", "2", "--", "/bin/true"}, {}, 30)),
            2);
  EXPECT_EQ(exit_code(run_with_timeout(
                {moe_binary(), "launch", "--nproc-per-node", "1", "--master", "h:port", "--", "/bin/true"}, {}, 30)),
            2);
}

}  // namespace
