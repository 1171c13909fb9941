// Helpers for the observability tests: scratch directories, running commands, and the
// tiny synthetic-data trainer whose metrics the tests read back.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "shell_command.h"
#include "train/trainer.h"
#include "train/synthetic.h"

namespace moe::test {

inline std::filesystem::path scratch_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = "moe_obs_" + tag + "_" + std::to_string(::getpid()) + "_" + info->name();
  std::replace(name.begin(), name.end(), '/', '_');  // parameterised tests: "Test/0" (one level, removable)
  auto dir = std::filesystem::temp_directory_path() / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}


inline std::string python() { return oracle_python(); }

inline std::string moe_binary() {
  if (const char* path = std::getenv("MOE_BINARY"); path && *path) return path;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "moe").string();
}

// Headless Chromium (Debian's chromium, installed by scripts/setup.sh). --dump-dom prints
// the DOM after the load event: both pages draw from inlined data while loading, so no
// waiting is needed (a --virtual-time-budget never ends with Chart.js on the page).
// Its profile goes to a scratch directory that is removed afterwards.
inline CommandResult run_chromium(const std::string& args) {
  const auto profile = std::filesystem::temp_directory_path() / ("moe_obs_chromium_" + std::to_string(::getpid()));
  CommandResult r = run_command("timeout 60 chromium --headless --disable-gpu --no-sandbox --no-first-run "
                                "--disable-extensions --disable-dev-shm-usage --user-data-dir=" +
                                profile.string() + " " + args);
  std::error_code ec;
  std::filesystem::remove_all(profile, ec);
  return r;
}

// A 2-layer MoE on the look-back task: 4 experts, top-2, 256 tokens per step.
inline RunConfig tiny_config(int64_t steps) {
  RunConfig config;
  ModelConfig& m = config.model;
  m.vocab_size = 16;
  m.dim = 16;
  m.n_layers = 2;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.seq_len = 16;
  m.moe.n_experts = 4;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 16;
  config.training.micro_batch = 8;
  config.training.global_batch_tokens = 256;  // 2 micro-batches
  config.training.steps = steps;
  config.training.val_batches = 2;
  config.training.val_interval = 0;
  config.training.threads = 1;
  config.lr.warmup_steps = 2;
  config.metrics.log_interval = 2;
  return config;
}

inline std::unique_ptr<Trainer> tiny_trainer(const RunConfig& config) {
  const auto& m = config.model;
  return std::make_unique<Trainer>(config, std::make_unique<LookBackTask>(m.vocab_size, m.seq_len, 1),
                                   std::make_unique<LookBackTask>(m.vocab_size, m.seq_len, 2));
}

}  // namespace moe::test
