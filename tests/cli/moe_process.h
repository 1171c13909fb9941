// Runs the `moe` binary as a user would (stdout and stderr together) for the CLI tests.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <string>

#include "shell_command.h"

namespace moe::test {

using MoeResult = CommandResult;  // exit code 124: killed by run_moe's time limit

inline std::string moe_binary() {
  // ctest sets MOE_BINARY; run by hand, the binary sits beside the test executable.
  const char* path = std::getenv("MOE_BINARY");
  if (path && *path) return path;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "moe").string();
}

// `moe ARGS`, run through the shell (so `args` may hold redirections and quotes), killed
// after `limit_seconds` (exit code 124 or 137): a regression that hangs fails, not stalls.
// With `merge_stderr` false the output is stdout alone and `args` redirects stderr itself.
inline MoeResult run_moe(const std::string& args, int limit_seconds = 120, bool merge_stderr = true) {
  return run_command("timeout -k 5 " + std::to_string(limit_seconds) + " " + moe_binary() + " " + args, merge_stderr);
}

// A failed command: the expected exit code, one line of output, holding every fragment.
inline void expect_one_line_error(const MoeResult& r, int code, std::initializer_list<std::string> fragments) {
  EXPECT_EQ(r.exit_code, code) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  for (const auto& f : fragments) EXPECT_NE(r.output.find(f), std::string::npos) << f << " not in: " << r.output;
}

// A fresh directory named after the running test, removed afterwards.
class CliTempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("moe_cli_input_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

}  // namespace moe::test
